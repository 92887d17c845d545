#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/checkpoint.hpp"
#include "stagewise/runtime/rng_section.hpp"
#include "stagewise/runtime/stream.hpp"
#include "stagewise/runtime/worker.hpp"
#include "stagewise/stage/stage_spec.hpp"

#include <c10/core/DeviceGuard.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace stagewise::runtime {

/// A stage as the executors see it: its function, device, worker thread, compute stream, copy
/// streams (one per micro-batch, made on demand) and random-number section.
struct StageRuntime {
  StageRuntime(detail::StageSpec s, torch::Device d)
      : spec(std::move(s)), device(d), compute(default_stream(d)), rng(d) {}

  detail::StageSpec spec;
  torch::Device device;
  c10::Stream compute;
  RngSection rng;
  std::vector<c10::Stream> copy_streams;
  Worker worker;  // last: destroyed (joined) first

  const c10::Stream& copy_stream(std::size_t micro) {
    while (copy_streams.size() <= micro) copy_streams.push_back(new_stream(device));
    return copy_streams[micro];
  }

  /// Moves a batch produced on `from` (another stage's device and stream) to this stage.
  Batch receive(const Batch& b, const StageRuntime& from, std::size_t micro) {
    if (from.device == device) return b;
    std::vector<torch::Tensor> out;
    out.reserve(b.size());
    for (const auto& t : b) out.push_back(copy_to(t, device, from.compute, copy_stream(micro), compute));
    if (b.atomic()) return Batch(std::move(out.front()));
    return Batch(std::move(out));
  }

  /// Runs the stage on this thread: plainly, or checkpointed (`checkpointed`), inside the
  /// random-number section when exact replay matters (`replay`).
  Batch run(const Batch& in, bool checkpointed, bool replay, bool training) {
    std::optional<c10::DeviceGuard> device_guard;
    std::optional<c10::StreamGuard> stream_guard;
    if (device.type() != torch::kCPU) {
      device_guard.emplace(device);
      stream_guard.emplace(compute);
    }
    if (checkpointed) {
      auto atomic = std::make_shared<bool>(in.atomic());
      const bool input_atomic = in.atomic();
      auto fn = [this, atomic, input_atomic](const std::vector<torch::Tensor>& xs) {
        Batch out = spec.fn(input_atomic ? Batch(xs.front()) : Batch(xs));
        *atomic = out.atomic();
        return std::vector<torch::Tensor>(out.begin(), out.end());
      };
      detail::run_section section;
      if (replay) section = [this, training](const std::function<void()>& body) { rng.run(training, body); };
      auto outs = detail::checkpoint_tensors(std::move(fn), {in.begin(), in.end()}, std::move(section));
      if (*atomic) return Batch(std::move(outs.front()));
      return Batch(std::move(outs));
    }
    if (!replay) return spec.fn(in);
    std::optional<Batch> out;
    rng.run(training, [&] { out.emplace(spec.fn(in)); });
    return std::move(*out);
  }
};

}  // namespace stagewise::runtime
