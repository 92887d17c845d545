#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/types.h>

namespace stagewise::runtime {

/// Device-generic stream helpers: on the CPU every stream is the one default stream and every
/// operation here is a no-op; on CUDA (through LibTorch's device-generic guard interface, so this
/// compiles against a CPU-only LibTorch too) they order copies and computations across streams.
///   auto s = stagewise::runtime::new_stream(device);      // a copy stream from the pool
///   stagewise::runtime::wait_stream(s, compute);          // s waits for compute's queued work
inline c10::Stream default_stream(const torch::Device& device) {
  if (device.type() == torch::kCPU) return c10::Stream(c10::Stream::DEFAULT, device);
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

/// A stream from the device's pool (the default stream on the CPU).
inline c10::Stream new_stream(const torch::Device& device) {
  if (device.type() == torch::kCPU) return default_stream(device);
  return c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
}

/// Makes `waiter` wait for the work queued on `source` so far.
inline void wait_stream(const c10::Stream& waiter, const c10::Stream& source) {
  if (waiter == source || waiter.device_type() == torch::kCPU ||
      source.device_type() == torch::kCPU) {
    return;
  }
  c10::Event event(source.device_type());
  event.record(source);
  event.block(waiter);
}

/// Tells the caching allocator that `tensor` is used on `stream`, so its block is not reused
/// before that stream's work is done.
inline void record_stream(const torch::Tensor& tensor, const c10::Stream& stream) {
  if (tensor.defined() && tensor.device().type() != torch::kCPU &&
      stream.device_type() != torch::kCPU) {
    tensor.record_stream(stream);
  }
}

/// Copies `tensor` to `device` on `copy_stream` after `source_stream`'s work on it; the copy's
/// result is ready for `target_stream` when this returns (on the CPU: a plain `.to(device)`).
inline torch::Tensor copy_to(const torch::Tensor& tensor, const torch::Device& device,
                             const c10::Stream& source_stream, const c10::Stream& copy_stream,
                             const c10::Stream& target_stream) {
  if (tensor.device() == device) return tensor;
  if (device.type() == torch::kCPU && tensor.device().type() == torch::kCPU) {
    return tensor.to(device);
  }
  wait_stream(copy_stream, source_stream);
  torch::Tensor out;
  {
    c10::StreamGuard guard(copy_stream);
    out = tensor.to(device, /*non_blocking=*/true);
  }
  record_stream(tensor, copy_stream);
  record_stream(out, target_stream);
  wait_stream(target_stream, copy_stream);
  return out;
}

}  // namespace stagewise::runtime
