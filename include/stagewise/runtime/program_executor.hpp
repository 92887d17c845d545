#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/checkpoint_state.hpp"
#include "stagewise/core/rng.hpp"
#include "stagewise/runtime/clock_executor.hpp"
#include "stagewise/runtime/split_backward.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/timeline.hpp"
#include "stagewise/skip/train_skips.hpp"

#include <ATen/ThreadLocalState.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace stagewise::runtime {

using loss_fn_t = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;

namespace detail {

// Messages between stage workers: activations forward, gradients backward. Any failure sets
// `aborted` and wakes everyone, so no worker waits for a message that will never come.
class Mailboxes {
 public:
  Mailboxes(int n, int m) : m_(m), acts_(n * m), grads_(n * m), wake_(n) {}

  void post_activation(int stage, int micro, Batch b) {
    post(stage, [&] { acts_[index(stage, micro)].emplace(std::move(b)); });
  }
  void post_gradient(int stage, int micro, std::vector<torch::Tensor> g) {
    post(stage, [&] { grads_[index(stage, micro)].emplace(std::move(g)); });
  }
  std::optional<Batch> take_activation(int stage, int micro) {
    return take(stage, acts_[index(stage, micro)]);
  }
  std::optional<std::vector<torch::Tensor>> take_gradient(int stage, int micro) {
    return take(stage, grads_[index(stage, micro)]);
  }

  void abort(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = e;
      aborted_ = true;
    }
    for (auto& cv : wake_) cv.notify_all();
  }
  std::exception_ptr error() const { return error_; }  // read after every worker finished

 private:
  std::size_t index(int stage, int micro) const {
    return static_cast<std::size_t>(stage) * m_ + micro;
  }

  template <class F>
  void post(int stage, F&& put) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      put();
    }
    wake_[stage].notify_one();
  }

  template <class T>
  std::optional<T> take(int stage, std::optional<T>& slot) {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_[stage].wait(lock, [&] { return aborted_ || slot.has_value(); });
    if (!slot) return std::nullopt;
    std::optional<T> out = std::move(slot);
    slot.reset();
    return out;
  }

  int m_;
  std::mutex mutex_;
  std::vector<std::optional<Batch>> acts_;
  std::vector<std::optional<std::vector<torch::Tensor>>> grads_;
  std::vector<std::condition_variable> wake_;
  bool aborted_ = false;
  std::exception_ptr error_;
};

struct Aborted {};  // thrown inside a worker when another one failed

// What one stage keeps for one micro-batch between its forward and its backward.
struct CellMemory {
  std::vector<torch::Tensor> leaves;  // the inputs, as leaves of this stage's graph
  bool input_atomic = true;
  std::vector<torch::Tensor> outputs;  // with their graph (empty while checkpointed)
  torch::Tensor loss;                  // last stage only
  std::optional<RngState> rng;         // checkpointed cells only
  std::optional<SplitBackward> split;  // between I and W
};

}  // namespace detail

/// Everything one training step needs, shared by the stage workers.
struct TrainStep {
  std::vector<Batch> inputs;
  std::vector<Batch> targets;
  std::vector<double> weights;  // each micro-batch's share of the loss
  loss_fn_t loss_fn;
  int64_t stop = 0;  // micro-batches below it are checkpointed
  bool training = true;
  std::chrono::steady_clock::time_point start;  // time zero of a recorded timeline
  std::shared_ptr<::stagewise::detail::TrainSkips> skips;  // skip connections; null: none
};

namespace detail {

// F: runs stage j on micro-batch i from `x` and keeps what its backward needs; returns the output.
inline Batch forward_cell(StageRuntime& stage, int j, int i, bool last, Batch x, TrainStep& step,
                          CellMemory& cell, torch::Tensor& total) {
  const bool replay = step.stop > 0;
  cell.input_atomic = x.atomic();
  for (const auto& t : x) {
    const bool grad = j > 0 && (t.is_floating_point() || t.is_complex());
    cell.leaves.push_back(t.detach().requires_grad_(grad));
  }
  auto run = [&] {
    auto call = [&] {
      return stage.spec.fn(cell.input_atomic ? Batch(cell.leaves.front()) : Batch(cell.leaves));
    };
    Batch out = step.skips ? step.skips->run(j, i, call) : call();
    if (last) {
      TORCH_CHECK(out.atomic() && step.targets[i].atomic(),
                  "stagewise::train_step: the last stage must return one Tensor and the target "
                  "must be one Tensor, to call loss_fn(output, target)");
      cell.loss = step.loss_fn(out.tensor(), step.targets[i].tensor()) * step.weights[i];
    }
    return out;
  };
  std::optional<Batch> out;
  if (i < step.stop) {
    stage.rng.run(step.training, [&] {
      cell.rng = RngState::capture(stage.device);
      torch::NoGradGuard no_grad;
      auto scope = ::stagewise::detail::checkpointing_scope();
      out.emplace(run());
    });
  } else if (replay) {
    stage.rng.run(step.training, [&] { out.emplace(run()); });
  } else {
    out.emplace(run());
  }
  if (last) {
    auto value = cell.loss.detach();
    total = total.defined() ? total + value : value;
    if (i < step.stop) cell.loss = torch::Tensor();  // recomputed with grad later
  }
  if (i >= step.stop) cell.outputs.assign(out->begin(), out->end());
  return std::move(*out);
}

// R: re-runs a checkpointed cell with grad enabled and its forward's random numbers.
inline void recompute_cell(StageRuntime& stage, int j, int i, bool last, TrainStep& step,
                           CellMemory& cell) {
  stage.rng.run(step.training, [&] {
    // A stage known to draw nothing runs without the lock, and rewinding the process-wide
    // generator there would disturb a drawing stage running at the same time; it needs no
    // replay anyway. (Its first run, an F, has taught the section which kind it is.)
    std::optional<RngState::Restore> replay_rng;
    if (!stage.rng.draws_nothing(step.training)) replay_rng.emplace(*cell.rng);
    auto scope = ::stagewise::detail::recomputing_scope();
    auto call = [&] {
      return stage.spec.fn(cell.input_atomic ? Batch(cell.leaves.front()) : Batch(cell.leaves));
    };
    Batch out = step.skips ? step.skips->run(j, i, call) : call();
    if (last) cell.loss = step.loss_fn(out.tensor(), step.targets[i].tensor()) * step.weights[i];
    cell.outputs.assign(out.begin(), out.end());
  });
}

// The outputs to differentiate and their gradients: the loss on the last stage, else the outputs
// that require grad and got a gradient from the next stage.
inline void backward_roots(const CellMemory& cell, bool last, const std::vector<torch::Tensor>* g,
                           std::vector<torch::Tensor>& outs, std::vector<torch::Tensor>& grads) {
  if (last) {
    outs.push_back(cell.loss);
    grads.push_back(torch::ones_like(cell.loss));
    return;
  }
  for (std::size_t k = 0; k < cell.outputs.size() && k < g->size(); ++k) {
    if (cell.outputs[k].requires_grad() && (*g)[k].defined()) {
      outs.push_back(cell.outputs[k]);
      grads.push_back((*g)[k]);
    }
  }
}

}  // namespace detail

/// Runs worker `w`'s actions of `plan` in order (called on that worker's thread): F takes the
/// activation from the mailbox and posts its output to the next stage; R recomputes a
/// checkpointed cell; B runs the cell's backward and posts its input gradients; I posts the input
/// gradients and keeps the rest for W, which accumulates the weight gradients. A worker may run
/// several stages (interleaved schedules). Appends each action's times to `record` if given.
/// Returns the summed loss of the micro-batches whose last stage ran here.
inline torch::Tensor run_program(std::vector<std::unique_ptr<StageRuntime>>& stages,
                                 const schedule::Plan& plan, int w, TrainStep& step,
                                 detail::Mailboxes& mail,
                                 std::vector<schedule::TimedAction>* record) {
  using schedule::ActionKind;
  const int n = plan.stages;
  const int m = plan.micro_batches;
  std::vector<std::vector<detail::CellMemory>> cells(static_cast<std::size_t>(n));
  torch::Tensor total;
  auto now = [&] {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - step.start)
        .count();
  };

  for (const auto& a : plan.programs[static_cast<std::size_t>(w)]) {
    const int j = a.stage;
    const int i = a.micro;
    const bool last = j == n - 1;
    StageRuntime& stage = *stages[static_cast<std::size_t>(j)];
    auto& row = cells[static_cast<std::size_t>(j)];
    if (row.empty()) row.resize(static_cast<std::size_t>(m));
    auto& cell = row[static_cast<std::size_t>(i)];
    std::optional<c10::DeviceGuard> device_guard;
    std::optional<c10::StreamGuard> stream_guard;
    if (stage.device.type() != torch::kCPU) {
      device_guard.emplace(stage.device);
      stream_guard.emplace(stage.compute);
    }
    // Wait for what the action consumes; its recorded time starts once that is here.
    std::optional<Batch> received;
    std::optional<std::vector<torch::Tensor>> grad;
    if (a.kind == ActionKind::forward) {
      received = j == 0 ? std::optional<Batch>(step.inputs[static_cast<std::size_t>(i)])
                        : mail.take_activation(j, i);
      if (!received) throw detail::Aborted{};
    }
    if ((a.kind == ActionKind::backward || a.kind == ActionKind::input_grad) && !last) {
      grad = mail.take_gradient(j, i);
      if (!grad) throw detail::Aborted{};
    }
    const double start = record ? now() : 0.0;
    switch (a.kind) {
      case ActionKind::forward: {
        Batch x = j == 0 ? *received
                         : stage.receive(*received, *stages[static_cast<std::size_t>(j - 1)], i);
        if (step.skips && !step.skips->receive(stages, j, i)) throw detail::Aborted{};
        Batch out = detail::forward_cell(stage, j, i, last, std::move(x), step, cell, total);
        if (step.skips) step.skips->send(j, i);
        if (!last) {
          std::vector<torch::Tensor> sent;
          for (const auto& t : out) sent.push_back(t.detach());
          mail.post_activation(j + 1, i, out.atomic() ? Batch(sent.front()) : Batch(sent));
        }
        break;
      }
      case ActionKind::recompute:
        detail::recompute_cell(stage, j, i, last, step, cell);
        break;
      case ActionKind::backward: {
        std::vector<torch::Tensor> outs;
        std::vector<torch::Tensor> grads;
        detail::backward_roots(cell, last, grad ? &*grad : nullptr, outs, grads);
        if (step.skips && !step.skips->add_roots(j, i, outs, grads)) throw detail::Aborted{};
        if (!outs.empty()) torch::autograd::backward(outs, grads);
        if (step.skips) step.skips->send_grads(j, i);
        if (j > 0) {
          std::vector<torch::Tensor> input_grads;
          for (auto& leaf : cell.leaves) input_grads.push_back(leaf.grad());
          mail.post_gradient(j - 1, i, std::move(input_grads));
        }
        cell = detail::CellMemory{};  // free this cell's activations now
        break;
      }
      case ActionKind::input_grad: {
        std::vector<torch::Tensor> outs;
        std::vector<torch::Tensor> grads;
        detail::backward_roots(cell, last, grad ? &*grad : nullptr, outs, grads);
        cell.split.emplace();
        auto input_grads = cell.split->input_grad(std::move(outs), std::move(grads), cell.leaves);
        if (j > 0) mail.post_gradient(j - 1, i, std::move(input_grads));
        cell.outputs.clear();  // the split holds the graph until W
        cell.loss = torch::Tensor();
        break;
      }
      case ActionKind::weight_grad: {
        TORCH_CHECK(cell.split, "stagewise::train_step: ", schedule::to_string(a),
                    " runs before its input-gradient pass; verify the schedule");
        cell.split->weight_grad();
        cell = detail::CellMemory{};
        break;
      }
    }
    if (record) record->push_back({a, w, start, now()});
  }
  return total;
}

/// Runs every worker's program of `plan` concurrently (worker w on stage w's thread) and returns
/// the summed, weighted loss. A failure in any stage stops all of them; the first exception is
/// rethrown unchanged. If `timeline` is given, it receives every action's start and end, in
/// microseconds from the start of the step.
inline torch::Tensor run_programs(std::vector<std::unique_ptr<StageRuntime>>& stages,
                                  const schedule::Plan& plan, TrainStep& step,
                                  schedule::Timeline* timeline = nullptr) {
  TORCH_CHECK(plan.stages == static_cast<int>(stages.size()),
              "stagewise::train_step: the plan has ", plan.stages, " stages but the pipe ",
              stages.size(), "; plan for the pipe's stages");
  const int workers = plan.workers;
  detail::Mailboxes mail(plan.stages, plan.micro_batches);
  const at::ThreadLocalState state;
  std::mutex mutex;
  std::condition_variable done;
  int pending = workers;
  torch::Tensor loss;
  std::vector<std::vector<schedule::TimedAction>> records(static_cast<std::size_t>(workers));
  const int last_worker = plan.worker_of(plan.stages - 1);
  step.start = std::chrono::steady_clock::now();
  for (int w = 0; w < workers; ++w) {
    stages[static_cast<std::size_t>(w)]->worker.post([&, w] {
      try {
        at::ThreadLocalStateGuard guard(state);
        auto total = run_program(stages, plan, w, step, mail,
                                 timeline ? &records[static_cast<std::size_t>(w)] : nullptr);
        if (w == last_worker) loss = total;
      } catch (const detail::Aborted&) {
        // another stage failed first; its exception is the one reported
      } catch (...) {
        mail.abort(std::current_exception());
        if (step.skips) step.skips->abort();  // wake workers waiting for a skip
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (--pending == 0) done.notify_one();
    });
  }
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [&] { return pending == 0; });
  if (auto e = mail.error()) std::rethrow_exception(e);
  if (timeline) {
    timeline->stages = plan.stages;
    timeline->micro_batches = plan.micro_batches;
    timeline->workers = workers;
    timeline->unit = "us";
    timeline->actions.clear();
    for (auto& r : records) timeline->actions.insert(timeline->actions.end(), r.begin(), r.end());
    std::stable_sort(timeline->actions.begin(), timeline->actions.end(),
                     [](const schedule::TimedAction& x, const schedule::TimedAction& y) {
                       return x.start < y.start;
                     });
  }
  return loss;
}

}  // namespace stagewise::runtime
