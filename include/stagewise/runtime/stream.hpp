#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/types.h>

#include <chrono>
#include <optional>
#include <thread>

namespace stagewise::runtime {

/// Device-generic stream helpers: on the CPU every stream is the one CPU stream and ordering is a
/// no-op; on CUDA (through LibTorch's device-generic guard interface, so this compiles against a
/// CPU-only LibTorch too) they order copies and computations across streams.
///   auto s = stagewise::runtime::new_stream(device);      // a copy stream from the pool
///   stagewise::runtime::wait_stream(s, compute);          // s waits for compute's queued work
///
/// The stream the calling thread queues work on for `device` now (on CUDA: its current stream,
/// the default stream unless a guard set another).
inline c10::Stream current_stream(const torch::Device& device) {
  if (device.type() == torch::kCPU) return c10::Stream(c10::Stream::DEFAULT, device);
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

/// A stream from the device's pool (the CPU stream on the CPU).
inline c10::Stream new_stream(const torch::Device& device) {
  if (device.type() == torch::kCPU) return current_stream(device);
  return c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
}

/// Makes `waiter` wait for the work queued on `source` so far (nothing to order when either is
/// the CPU: CPU work is done when its thread hands a tensor over).
inline void wait_stream(const c10::Stream& waiter, const c10::Stream& source) {
  if (waiter == source || waiter.device_type() == torch::kCPU ||
      source.device_type() == torch::kCPU) {
    return;
  }
  c10::Event event(source.device_type());
  event.record(source);
  event.block(waiter);
}

/// Blocks the calling thread until the work `event` recorded is done (LibTorch's device-generic
/// event has no wait of its own in every version: it is polled, every 20 microseconds). For a
/// host thread that reads what a copy to the host wrote.
inline void wait_event(const c10::Event& event) {
  while (!event.query()) std::this_thread::sleep_for(std::chrono::microseconds(20));
}

/// Tells the caching allocator that `tensor` is used on `stream`, so its block is not reused
/// before that stream's work is done.
inline void record_stream(const torch::Tensor& tensor, const c10::Stream& stream) {
  if (tensor.defined() && tensor.device().type() != torch::kCPU &&
      stream.device_type() != torch::kCPU) {
    tensor.record_stream(stream);
  }
}

/// The one place a tensor crosses devices. Copies `tensor`, written by work queued on `source`
/// (a stream of its device), to `device`. Contract: when this returns, the result is ready for
/// work queued on `target` (a stream of `device`), and `tensor` may be freed or overwritten at
/// once. `copy` is the stream for the copy on the GPU side; when it is not on that side (e.g. a
/// CPU stage's), a stream from that device's pool is used.
///   - to a GPU (from the CPU or another GPU): the copy runs on a stream of `device` after
///     `source`, and `target` waits for it; the allocator learns every stream that uses either
///     tensor. A pinned CPU source is copied blocking (its DMA would read it after the call); a
///     pageable one the driver stages before returning.
///   - from a GPU to the CPU: the copy runs on a stream of the source GPU after `source` and this
///     waits for it, since the CPU has no stream to order its reads on. (A non-blocking copy to the
///     CPU returns pinned memory that the GPU fills later: reading it at once reads stale data.)
///   - on one device: the tensor itself, with `target` waiting for `source` if they differ.
inline torch::Tensor copy_to(const torch::Tensor& tensor, const torch::Device& device,
                             const c10::Stream& source, const c10::Stream& copy,
                             const c10::Stream& target) {
  if (!tensor.defined()) return tensor;
  const torch::Device from = tensor.device();
  if (from == device) {
    if (source != target) {
      wait_stream(target, source);
      record_stream(tensor, target);
    }
    return tensor;
  }
  if (from.type() == torch::kCPU && device.type() == torch::kCPU) return tensor.to(device);
  torch::Tensor out;
  if (device.type() == torch::kCPU) {
    const c10::Stream on_gpu = copy.device() == from ? copy : new_stream(from);
    wait_stream(on_gpu, source);
    {
      c10::StreamGuard guard(on_gpu);
      out = tensor.to(device, /*non_blocking=*/true);
    }
    on_gpu.synchronize();
    return out;
  }
  const c10::Stream into = copy.device() == device ? copy : new_stream(device);
  if (from.type() == torch::kCPU) {
    const bool pinned = tensor.is_pinned();
    c10::StreamGuard guard(into);
    out = tensor.to(device, /*non_blocking=*/!pinned);
  } else {
    // Between GPUs, LibTorch copies on the source device's current stream after the
    // destination's, and makes the destination's current stream wait for the copy: both are set
    // here, the source side to a stream that first waits for `source`.
    const c10::Stream out_of = new_stream(from);
    wait_stream(out_of, source);
    c10::StreamGuard source_side(out_of);
    c10::StreamGuard target_side(into);
    out = tensor.to(device, /*non_blocking=*/true);
    record_stream(tensor, out_of);
  }
  record_stream(out, target);
  wait_stream(target, into);
  return out;
}

/// copy_to for work on the calling thread: `tensor` was written on this thread's current stream
/// of its device, and the result is used on this thread's current stream of `device`.
inline torch::Tensor copy_to(const torch::Tensor& tensor, const torch::Device& device) {
  if (!tensor.defined() || tensor.device() == device) return tensor;
  const c10::Stream target = current_stream(device);
  return copy_to(tensor, device, current_stream(tensor.device()), target, target);
}

}  // namespace stagewise::runtime
