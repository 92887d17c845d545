#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/checkpoint.hpp"
#include "stagewise/core/error_context.hpp"
#include "stagewise/core/detail/stage_spec.hpp"
#include "stagewise/runtime/rng_section.hpp"
#include "stagewise/runtime/stream.hpp"
#include "stagewise/threads/worker.hpp"

#include <c10/core/DeviceGuard.h>
#include <torch/types.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace stagewise::runtime {

/// A stage's function over batches.
using stage_call = std::function<Batch(const Batch&)>;
/// Runs one cell's stage function (the second argument) on a batch, with whatever the cell needs
/// around it: skip connections install their tracker this way. Called again by the recompute.
using cell_wrapper = std::function<Batch(const Batch&, const stage_call&)>;

/// A stage as the executors see it: its function, device, worker thread, compute stream, copy
/// streams (one per micro-batch, made on demand) and random-number section.
struct StageRuntime {
  StageRuntime(::stagewise::detail::StageSpec s, torch::Device d)
      : spec(std::move(s)), device(d), compute(current_stream(d)), rng(d) {}

  ::stagewise::detail::StageSpec spec;
  torch::Device device;
  c10::Stream compute;
  RngSection rng;
  std::vector<c10::Stream> copy_streams;
  Worker worker;  // last: destroyed (joined) first

  // The stream that wrote `t`: stage `from`'s compute stream, or (null) this thread's current one.
  c10::Stream source_of(const torch::Tensor& t, const StageRuntime* from) const {
    return from != nullptr ? from->compute : current_stream(t.device());
  }

  // Whether `t` must cross to this stage's device, or wait for another stream than its compute.
  bool needs_move(const torch::Tensor& t, const StageRuntime* from) const {
    return t.defined() && (t.device() != device || source_of(t, from) != compute);
  }

  const c10::Stream& copy_stream(std::size_t micro) {
    while (copy_streams.size() <= micro) copy_streams.push_back(new_stream(device));
    return copy_streams[micro];
  }

  /// Moves a tensor produced by stage `from` (its device and compute stream; null: the caller
  /// or a stage in another process, whose tensor was written on this thread's current stream of
  /// its device) to this stage's device, ready for this stage's compute stream, on micro-batch
  /// `micro`'s copy stream (`copy_to`'s contract). Inputs, targets, activations, gradients and
  /// skips all cross devices here.
  torch::Tensor take_in(const torch::Tensor& t, const StageRuntime* from, std::size_t micro) {
    if (!needs_move(t, from)) return t;
    return copy_to(t, device, source_of(t, from), copy_stream(micro), compute);
  }

  /// Moves a batch produced by stage `from` (null: the caller, or another process) to this stage;
  /// the batch itself when nothing in it has to move.
  Batch receive(const Batch& b, const StageRuntime* from, std::size_t micro) {
    if (std::none_of(b.begin(), b.end(), [&](const auto& t) { return needs_move(t, from); })) {
      return b;
    }
    std::vector<torch::Tensor> out;
    out.reserve(b.size());
    for (const auto& t : b) out.push_back(take_in(t, from, micro));
    if (b.atomic()) return Batch(std::move(out.front()));
    return Batch(std::move(out));
  }

  /// Moves every micro-batch the caller gives (on this thread's streams) to this stage, in place:
  /// a step's inputs to stage 0, its targets to the last stage.
  void receive_from_caller(std::vector<Batch>& micro_batches) {
    for (std::size_t i = 0; i < micro_batches.size(); ++i) {
      micro_batches[i] = receive(micro_batches[i], nullptr, i);
    }
  }

  /// Runs the stage on this thread: plainly, or checkpointed (`checkpointed`), inside the
  /// random-number section when exact replay matters (`replay`); through `wrap` when given.
  /// `where` (the cell) is named in the context of exceptions from a checkpointed cell's
  /// recompute and backward, which run later, in the caller's backward.
  Batch run(const Batch& in, bool checkpointed, bool replay, bool training,
            cell_wrapper wrap = nullptr, std::optional<ErrorContext> where = {}) {
    std::optional<c10::DeviceGuard> device_guard;
    std::optional<c10::StreamGuard> stream_guard;
    if (device.type() != torch::kCPU) {
      device_guard.emplace(device);
      stream_guard.emplace(compute);
    }
    if (checkpointed) {
      auto atomic = std::make_shared<bool>(in.atomic());
      const bool input_atomic = in.atomic();
      auto fn = [this, atomic, input_atomic, wrap](const std::vector<torch::Tensor>& xs) {
        const Batch in = input_atomic ? Batch(xs.front()) : Batch(xs);
        Batch out = wrap ? wrap(in, spec.fn) : spec.fn(in);
        *atomic = out.atomic();
        return std::vector<torch::Tensor>(out.begin(), out.end());
      };
      ::stagewise::detail::run_section section;
      if (replay) {
        section.run = [this, training](const std::function<void()>& body) {
          rng.run(training, body);
        };
        section.draws_nothing = [this, training] { return rng.draws_nothing(training); };
      }
      auto outs = ::stagewise::detail::checkpoint_tensors(std::move(fn), {in.begin(), in.end()},
                                             std::move(section), where);
      if (*atomic) return Batch(std::move(outs.front()));
      return Batch(std::move(outs));
    }
    auto call = [&] { return wrap ? wrap(in, spec.fn) : spec.fn(in); };
    if (!replay) return call();
    std::optional<Batch> out;
    rng.run(training, [&] { out.emplace(call()); });
    return std::move(*out);
  }
};

/// Orders a pipe's work after the caller's and the caller's after the pipe's, on every GPU a
/// stage runs on: at construction each stage's compute stream waits for the calling thread's
/// current stream of its device (the optimizer's updates, the inputs), and at `leave` (or
/// destruction) those current streams wait for the stages (the gradients, the loss, the outputs).
/// Free when they are the same stream, as by default, and on the CPU. Null stages (another
/// process's) are skipped.
class StreamFence {
 public:
  explicit StreamFence(const std::vector<std::unique_ptr<StageRuntime>>& stages) : stages_(stages) {
    for (const auto& s : stages_) {
      if (s) wait_stream(s->compute, current_stream(s->device));
    }
  }
  StreamFence(const StreamFence&) = delete;
  StreamFence& operator=(const StreamFence&) = delete;
  ~StreamFence() { leave(); }

  /// Makes the caller's current streams wait for the stages' work so far (once).
  void leave() {
    if (left_) return;
    left_ = true;
    for (const auto& s : stages_) {
      if (s) wait_stream(current_stream(s->device), s->compute);
    }
  }

 private:
  const std::vector<std::unique_ptr<StageRuntime>>& stages_;
  bool left_ = false;
};

}  // namespace stagewise::runtime
