#pragma once

// runtime::OffloadedState's machinery: the held parameters, and each step's host steps in flight.
// A held parameter's final gradient and its value go to the host (a GPU's: copied by the copy
// engine on a stream of its own, queued in the gradient's hook after the work that made it, into
// pinned buffers; a CPU's gradient: cloned by a copier thread, which stands for that engine, so
// that the worker's gradient is freed as soon as it is copied, and its value by its host step);
// a host thread of the thread that handed it
// over then reads the state from the store, runs the optimizer's own step on the host tensors and
// stages the new state in the store; `finish` waits for them all, then commits the store and
// copies each new value back into its parameter (on the caller's current stream), or, if any
// failed, drops them all.

#include "stagewise/core/error_context.hpp"
#include "stagewise/optim/detail/fused_slot.hpp"
#include "stagewise/optim/detail/state_records.hpp"
#include "stagewise/optim/optimizer_for.hpp"
#include "stagewise/optim/state_offload.hpp"
#include "stagewise/runtime/detail/pinned_pool.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/runtime/stream.hpp"
#include "stagewise/threads/worker.hpp"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

using ::stagewise::detail::optimizer_state_key;
using ::stagewise::detail::record_of;
using ::stagewise::detail::state_kind_of;
using ::stagewise::detail::state_of;
using ::stagewise::detail::StateKind;

// A parameter whose state is held: the tensor, how errors name it, its key in the store.
struct HeldParameter {
  torch::Tensor param;
  std::string name;
  std::string key;
};

// One parameter's host step in flight.
struct HostJob {
  std::size_t held = 0;                 // into HostSteps' held parameters
  torch::Tensor grad, param;            // a CPU parameter's, until they are copied
  torch::Tensor grad_host, param_host;  // on the host
  std::optional<PinnedBuffer> grad_buffer, param_buffer;  // behind them, for a GPU parameter
  std::optional<c10::Event> landed;  // the device-to-host copies' end (a GPU parameter)
  std::unique_ptr<torch::optim::OptimizerOptions> options;
  std::exception_ptr error;
};

class HostSteps {
 public:
  // `who` opens errors, followed by " in <the store>".
  HostSteps(AnyStore store, const std::string& who)
      : store_(std::move(store)), who_(who + " in " + store_.describe()) {
    TORCH_CHECK(store_.keeps_state(), who, ": ", store_.describe(),
                " keeps no optimizer state (it is not a runtime::state_store); give a HostStore "
                "or a FileStore");
    static std::atomic<int> ids{0};
    prefix_ = "o" + std::to_string(ids.fetch_add(1) + 1) + ".p";
  }
  HostSteps(const HostSteps&) = delete;
  HostSteps& operator=(const HostSteps&) = delete;
  ~HostSteps() { abandon(); }

  // Holds the parameters `chosen` marks among `params` (names: for errors).
  void bind(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names,
            const optim::OptimizerFactory& factory, const std::vector<bool>& chosen) {
    TORCH_CHECK(!bound_, who_,
                ": it is bound to an optimizer already; give each optimizer an "
                "OffloadedState of its own");
    kind_ = state_kind_of(factory, who_);
    factory_ = factory;
    held_of_.assign(params.size(), -1);
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!chosen[i]) continue;
      const std::string name = i < names.size() && !names[i].empty()
                                   ? "parameter '" + names[i] + "'"
                                   : "parameter " + std::to_string(i);
      held_of_[i] = static_cast<int>(held_.size());
      held_.push_back({params[i], name, prefix_ + std::to_string(i)});
      held_bytes_ += static_cast<std::int64_t>(params[i].nbytes());
    }
    bound_ = true;
  }

  bool holds(std::size_t i) const { return i < held_of_.size() && held_of_[i] >= 0; }
  std::size_t size() const { return held_.size(); }
  std::int64_t held_bytes() const { return held_bytes_; }
  std::int64_t moved_last_step() const { return moved_last_step_.load(); }
  std::string store() const { return store_.describe(); }

  // Hands over parameter `i`'s final gradient: its copies start now, its host step on the host
  // thread of the calling thread.
  void submit(std::size_t i, const torch::Tensor& grad,
              const torch::optim::OptimizerOptions& options) {
    TORCH_CHECK(holds(i), who_, ": parameter ", i, " is not one it holds");
    auto job = std::make_shared<HostJob>();
    job->held = static_cast<std::size_t>(held_of_[i]);
    job->options = options.clone();
    const torch::Tensor& param = held_[job->held].param;
    Worker& steps = stepper();
    Worker* copies = param.device().is_cpu() ? &copier() : nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(job);
      ++running_;
    }
    if (copies != nullptr) {
      // The gradient is copied at once (the worker's is freed then); the value, which nothing
      // changes before finish, when its host step runs.
      job->grad = grad.detach();
      job->param = param.detach();
      copies->post([this, job, &steps] {
        try {
          job->grad_host = job->grad.clone();
        } catch (...) {
          job->error = std::current_exception();
        }
        job->grad = torch::Tensor();  // the worker's gradient goes now
        steps.post([this, job] { run(*job); });
      });
      return;
    }
    try {
      start_copies(*job, grad.detach(), param.detach());
    } catch (...) {
      job->error = std::current_exception();
    }
    steps.post([this, job] { run(*job); });
  }

  // Waits for the step's host steps; commits their state and copies the parameters back, or, if
  // one failed, drops them all and throws its error.
  void finish() {
    auto jobs = wait_all();
    for (const auto& job : jobs) {
      if (!job->error) continue;
      store_.discard_state();
      for (auto& j : jobs) release(*j);
      rethrow_failed(job->error, held_[job->held].name);
    }
    try {
      store_.commit_state();
    } catch (...) {
      store_.discard_state();
      throw;
    }
    std::int64_t moved = 0;
    torch::NoGradGuard no_grad;
    for (auto& job : jobs) {
      const torch::Tensor& param = held_[job->held].param;
      moved += 3 * static_cast<std::int64_t>(param.nbytes());  // gradient, value; value back
      if (!job->param_buffer) {
        param.detach().copy_(job->param_host);
        continue;
      }
      // From pinned memory, on the caller's current stream (later work on it, the next step's
      // forward included, reads the new value); the buffer is reused only once the copy is done.
      const c10::Stream stream = current_stream(param.device());
      param.detach().copy_(job->param_host, /*non_blocking=*/true);
      c10::Event copied(param.device().type());
      copied.record(stream);
      job->param_buffer->busy_until.emplace(std::move(copied));
      pool_.release(std::move(*job->param_buffer));
      job->param_buffer.reset();
    }
    moved_last_step_.store(moved);
  }

  // Waits for the step's host steps and drops them: nothing changes.
  void abandon() {
    auto jobs = wait_all();
    if (jobs.empty()) return;
    store_.discard_state();
    for (auto& j : jobs) release(*j);
  }

  std::unique_ptr<torch::optim::OptimizerParamState> state(std::size_t i) {
    if (!holds(i)) return nullptr;
    auto record = store_.read_state(held_[static_cast<std::size_t>(held_of_[i])].key);
    return record ? state_of(kind_, std::move(*record)) : nullptr;
  }

  void set_state(std::size_t i, std::unique_ptr<torch::optim::OptimizerParamState> s) {
    TORCH_CHECK(holds(i), who_, ": parameter ", i, " is not one it holds");
    const auto& key = held_[static_cast<std::size_t>(held_of_[i])].key;
    store_.write_state(
        key, s ? ::stagewise::detail::copy_to_host(record_of(kind_, *s)) : optim::StateRecord{});
    try {
      store_.commit_state();
    } catch (...) {
      store_.discard_state();
      throw;
    }
  }

 private:
  // A GPU parameter: its gradient and value copied to pinned buffers on the device's copy
  // stream, after the work queued so far on the calling thread's stream (which made the
  // gradient); the gradient's block is not reused before the copy has read it.
  void start_copies(HostJob& job, const torch::Tensor& grad, const torch::Tensor& param) {
    const torch::Device device = param.device();
    const c10::Stream compute = current_stream(device);
    const c10::Stream out = copy_stream(device);
    wait_stream(out, compute);
    auto host_view = [&](PinnedBuffer& b, const torch::Tensor& like) {
      return b.bytes.view(like.scalar_type()).view(like.sizes());
    };
    job.grad_buffer = pool_.acquire(static_cast<std::int64_t>(grad.numel() * grad.element_size()));
    job.param_buffer =
        pool_.acquire(static_cast<std::int64_t>(param.numel() * param.element_size()));
    job.grad_host = host_view(*job.grad_buffer, grad);
    job.param_host = host_view(*job.param_buffer, param);
    {
      c10::StreamGuard guard(out);
      job.grad_host.copy_(grad, /*non_blocking=*/true);
      job.param_host.copy_(param, /*non_blocking=*/true);
    }
    record_stream(grad, out);
    job.landed.emplace(device.type());
    job.landed->record(out);
  }

  // A step's buffers back to the pool once its host step is over (no copy reads them any more).
  void release(HostJob& job) {
    for (auto* b : {&job.grad_buffer, &job.param_buffer}) {
      if (!*b) continue;
      pool_.release(std::move(**b));
      b->reset();
    }
  }

  // The host step of `job`, on a host thread: never throws (its error is kept for finish).
  void run(HostJob& job) {
    if (job.landed) wait_event(*job.landed);  // the pinned buffers are filled
    if (!job.error) {
      try {
        step_on_host(job);
      } catch (...) {
        job.error = std::current_exception();
      }
    }
    if (job.grad_buffer) {
      pool_.release(std::move(*job.grad_buffer));
      job.grad_buffer.reset();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --running_;
    idle_.notify_all();
  }

  // The optimizer's own step on the host copies, from the kept state; the new one is staged.
  void step_on_host(HostJob& job) {
    torch::NoGradGuard no_grad;
    const HeldParameter& p = held_[job.held];
    if (job.param.defined()) {  // a CPU parameter's value
      job.param_host = job.param.clone();
      job.param = torch::Tensor();
    }
    auto record = store_.read_state(p.key);
    auto optimizer = factory_({job.param_host});
    optimizer->param_groups()[0].set_options(job.options->clone());
    const auto key = optimizer_state_key(job.param_host);
    if (record) optimizer->state()[key] = state_of(kind_, std::move(*record));
    job.param_host.mutable_grad() = job.grad_host;
    optimizer->step();
    job.param_host.mutable_grad().reset();
    job.grad_host = torch::Tensor();
    auto it = optimizer->state().find(key);
    store_.write_state(p.key, it == optimizer->state().end() ? optim::StateRecord{}
                                                             : record_of(kind_, *it->second));
  }

  [[noreturn]] void rethrow_failed(const std::exception_ptr& error, const std::string& name) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, who_, ": the host step of ", name,
                  " failed, so no parameter and no "
                  "optimizer state changed in this step: ",
                  ::stagewise::detail::message_of(e));
    }
    TORCH_CHECK(false, who_, ": the host step of ", name,
                " failed with an exception that is "
                "not a std::exception; no parameter and no optimizer state changed");
  }

  std::vector<std::shared_ptr<HostJob>> wait_all() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return running_ == 0; });
    return std::exchange(jobs_, {});
  }

  c10::Stream copy_stream(const torch::Device& device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = streams_.find(device.index());
    if (it == streams_.end()) it = streams_.emplace(device.index(), new_stream(device)).first;
    return it->second;
  }

  // The host thread of the calling thread (one per thread that hands gradients over: a pipe's
  // stage workers step on threads of their own), and the copier of CPU parameters.
  Worker& stepper() {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& w = steppers_[std::this_thread::get_id()];
    if (!w) w = std::make_unique<Worker>();
    return *w;
  }
  Worker& copier() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!copier_) copier_ = std::make_unique<Worker>();
    return *copier_;
  }

  AnyStore store_;
  std::string who_;
  std::string prefix_;  // of this one's keys in the store: "o<n>.p"
  bool bound_ = false;
  StateKind kind_ = StateKind::adam;
  optim::OptimizerFactory factory_;
  std::vector<HeldParameter> held_;
  std::vector<int> held_of_;  // per parameter of the optimizer: into held_, or -1
  std::int64_t held_bytes_ = 0;
  std::atomic<std::int64_t> moved_last_step_{0};
  PinnedPool pool_;
  std::mutex mutex_;
  std::condition_variable idle_;
  int running_ = 0;
  std::vector<std::shared_ptr<HostJob>> jobs_;  // this step's
  std::map<int, c10::Stream> streams_;          // device index -> its copy stream to the host
  // Last: the threads stop (finishing what is queued) before the members their tasks use go.
  std::map<std::thread::id, std::unique_ptr<Worker>> steppers_;
  std::unique_ptr<Worker> copier_;
};

}  // namespace stagewise::runtime::detail
