#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/checkpoint_state.hpp"
#include "stagewise/core/rng.hpp"
#include "stagewise/runtime/clock_executor.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/skip/train_skips.hpp"

#include <ATen/ThreadLocalState.h>
#include <torch/autograd.h>
#include <torch/types.h>

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

/// Each stage's actions in the order it performs them, from a schedule's stream of actions,
/// with a recompute inserted just before the first backward of every checkpointed micro-batch.
/// The worker runs a recompute as soon as its previous action is done, so it overlaps with the
/// later stages' backward instead of waiting for the gradient.
template <class Schedule>
std::vector<std::vector<schedule::Action>> stage_programs(const Schedule& sched, int n, int m,
                                                          int64_t stop) {
  std::vector<std::vector<schedule::Action>> programs(n);
  std::vector<char> recomputed(static_cast<std::size_t>(n) * m, 0);
  for (const auto& a : sched(n, m)) {
    TORCH_CHECK(a.stage >= 0 && a.stage < n && a.micro >= 0 && a.micro < m,
                "stagewise::train_step: the schedule yielded ", schedule::to_string(a),
                ", outside ", n, " stages and ", m, " micro-batches");
    const bool needs_grad = a.kind == schedule::ActionKind::backward ||
                            a.kind == schedule::ActionKind::input_grad;
    auto& done = recomputed[static_cast<std::size_t>(a.stage) * m + a.micro];
    if (needs_grad && a.micro < stop && !done) {
      programs[a.stage].push_back({a.stage, schedule::ActionKind::recompute, a.micro});
      done = 1;
    }
    programs[a.stage].push_back(a);
  }
  return programs;
}

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
  std::optional<Batch> take_activation(int stage, int micro) { return take(stage, acts_[index(stage, micro)]); }
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
  std::size_t index(int stage, int micro) const { return static_cast<std::size_t>(stage) * m_ + micro; }

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
  std::vector<torch::Tensor> leaves;   // the inputs, as leaves of this stage's graph
  bool input_atomic = true;
  std::vector<torch::Tensor> outputs;  // with their graph (empty while checkpointed)
  torch::Tensor loss;                  // last stage only
  std::optional<RngState> rng;         // checkpointed cells only
};

}  // namespace detail

/// Everything one training step needs, shared by the stage workers.
struct TrainStep {
  std::vector<Batch> inputs;
  std::vector<Batch> targets;
  std::vector<double> weights;  // each micro-batch's share of the loss
  loss_fn_t loss_fn;
  int64_t stop = 0;             // micro-batches below it are checkpointed
  bool training = true;
  std::shared_ptr<::stagewise::detail::TrainSkips> skips;  // skip connections; null: none
};

/// Runs one stage's program on its worker thread (called inside the worker).
inline torch::Tensor run_program(std::vector<std::unique_ptr<StageRuntime>>& stages, int j,
                                 const std::vector<schedule::Action>& program, TrainStep& step,
                                 detail::Mailboxes& mail) {
  using schedule::ActionKind;
  StageRuntime& stage = *stages[j];
  const int n = static_cast<int>(stages.size());
  const int m = static_cast<int>(step.inputs.size());
  const bool last = j == n - 1;
  const bool replay = step.stop > 0;
  std::vector<detail::CellMemory> cells(m);
  torch::Tensor total;
  std::optional<c10::DeviceGuard> device_guard;
  std::optional<c10::StreamGuard> stream_guard;
  if (stage.device.type() != torch::kCPU) {
    device_guard.emplace(stage.device);
    stream_guard.emplace(stage.compute);
  }

  auto* skips = step.skips.get();
  auto forward = [&](detail::CellMemory& cell, int i) {
    auto call = [&] {
      return stage.spec.fn(cell.input_atomic ? Batch(cell.leaves.front()) : Batch(cell.leaves));
    };
    Batch out = skips ? skips->run(j, i, call) : call();
    if (last) {
      TORCH_CHECK(out.atomic() && step.targets[i].atomic(),
                  "stagewise::train_step: the last stage must return one Tensor and the target "
                  "must be one Tensor, to call loss_fn(output, target)");
      cell.loss = step.loss_fn(out.tensor(), step.targets[i].tensor()) * step.weights[i];
    }
    return out;
  };

  for (const auto& a : program) {
    const int i = a.micro;
    auto& cell = cells[i];
    switch (a.kind) {
      case ActionKind::forward: {
        auto received = j == 0 ? std::optional<Batch>(step.inputs[i]) : mail.take_activation(j, i);
        if (!received) throw detail::Aborted{};
        Batch x = j == 0 ? *received : stage.receive(*received, *stages[j - 1], i);
        cell.input_atomic = x.atomic();
        for (const auto& t : x) {
          const bool grad = j > 0 && (t.is_floating_point() || t.is_complex());
          cell.leaves.push_back(t.detach().requires_grad_(grad));
        }
        if (skips && !skips->receive(stages, j, i)) throw detail::Aborted{};
        std::optional<Batch> out;
        if (i < step.stop) {
          auto body = [&] {
            cell.rng = RngState::capture(stage.device);
            torch::NoGradGuard no_grad;
            auto scope = ::stagewise::detail::checkpointing_scope();
            out.emplace(forward(cell, i));
          };
          stage.rng.run(step.training, body);
        } else if (replay) {
          stage.rng.run(step.training, [&] { out.emplace(forward(cell, i)); });
        } else {
          out.emplace(forward(cell, i));
        }
        if (skips) skips->send(j, i);
        if (last) {
          auto value = cell.loss.detach();
          total = total.defined() ? total + value : value;
          if (i < step.stop) cell.loss = torch::Tensor();  // recomputed with grad later
        } else {
          std::vector<torch::Tensor> sent;
          for (const auto& t : *out) sent.push_back(t.detach());
          mail.post_activation(j + 1, i, out->atomic() ? Batch(sent.front()) : Batch(sent));
        }
        if (i >= step.stop) cell.outputs.assign(out->begin(), out->end());
        break;
      }
      case ActionKind::recompute: {
        stage.rng.run(step.training, [&] {
          RngState::Restore replay_rng(*cell.rng);
          auto scope = ::stagewise::detail::recomputing_scope();
          Batch out = forward(cell, i);
          cell.outputs.assign(out.begin(), out.end());
        });
        break;
      }
      case ActionKind::backward: {
        if (last) {
          torch::autograd::backward({cell.loss});
        } else {
          auto g = mail.take_gradient(j, i);
          if (!g) throw detail::Aborted{};
          std::vector<torch::Tensor> outs;
          std::vector<torch::Tensor> grads;
          for (std::size_t k = 0; k < cell.outputs.size(); ++k) {
            if (cell.outputs[k].requires_grad() && (*g)[k].defined()) {
              outs.push_back(cell.outputs[k]);
              grads.push_back((*g)[k]);
            }
          }
          if (skips && !skips->add_roots(j, i, outs, grads)) throw detail::Aborted{};
          if (!outs.empty()) torch::autograd::backward(outs, grads);
        }
        if (skips) skips->send_grads(j, i);
        if (j > 0) {
          std::vector<torch::Tensor> input_grads;
          for (auto& leaf : cell.leaves) input_grads.push_back(leaf.grad());
          mail.post_gradient(j - 1, i, std::move(input_grads));
        }
        cell = detail::CellMemory{};  // free this cell's activations now
        break;
      }
      default:
        TORCH_CHECK(false, "stagewise::train_step: action ", schedule::to_string(a),
                    " is not supported by this executor; use forward, backward and recompute");
    }
  }
  return total;
}

/// Runs every stage's program concurrently on its worker and returns the summed, weighted loss.
/// A failure in any stage stops all of them; the first exception is rethrown unchanged.
inline torch::Tensor run_programs(std::vector<std::unique_ptr<StageRuntime>>& stages,
                                  const std::vector<std::vector<schedule::Action>>& programs,
                                  TrainStep& step) {
  const int n = static_cast<int>(stages.size());
  detail::Mailboxes mail(n, static_cast<int>(step.inputs.size()));
  const at::ThreadLocalState state;
  std::mutex mutex;
  std::condition_variable done;
  int pending = n;
  torch::Tensor loss;
  for (int j = 0; j < n; ++j) {
    stages[j]->worker.post([&, j] {
      try {
        at::ThreadLocalStateGuard guard(state);
        auto total = run_program(stages, j, programs[j], step, mail);
        if (j == n - 1) loss = total;
      } catch (const detail::Aborted&) {
        // another stage failed first; its exception is the one reported
      } catch (...) {
        mail.abort(std::current_exception());
        if (step.skips) step.skips->abort();
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (--pending == 0) done.notify_one();
    });
  }
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [&] { return pending == 0; });
  if (auto e = mail.error()) std::rethrow_exception(e);
  return loss;
}

}  // namespace stagewise::runtime
