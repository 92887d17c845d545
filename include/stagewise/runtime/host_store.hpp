#pragma once

#include "stagewise/runtime/detail/pinned_pool.hpp"
#include "stagewise/optim/state_offload.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/runtime/state_store.hpp"
#include "stagewise/runtime/stream.hpp"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// An offload store in host memory. For a GPU stage: pinned host buffers from a pool keyed by size
/// and reused step after step (no pinned allocation once the first step has run), device-to-host
/// copies on a stream of their own after the compute stream's work, host-to-device copies on
/// another, ordered by events: the device copy is freed only once its copy has landed (the
/// caching allocator learns the copy stream), a reload's copy starts only after the offload's has
/// landed, and the compute stream waits for the reload before anything reads it. For a CPU
/// stage the tensors are already in host memory: the store keeps them as they are (nothing is
/// saved; use `FileStore` to take them out of memory on a CPU-only machine).
/// It keeps optimizer state too (`state_store`, for `OffloadedState`): each parameter's as CPU
/// tensors, a step's new state beside the old until the step commits (so host memory holds up
/// to twice the offloaded state while a step runs).
///   auto options = sw::PipeOptions().chunks(8).offload(sw::runtime::HostStore());
class HostStore {
 public:
  HostStore() : state_(std::make_shared<State>()) {}

  /// Drops what a failed step left (its buffers go back to the pool).
  void begin_step(const std::vector<int>&) {
    std::map<std::pair<int, int>, std::vector<Held>> left;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      left.swap(state_->held);
    }
    for (auto& [key, items] : left) {
      for (auto& h : items) {
        if (h.buffer) {
          h.buffer->busy_until = std::move(h.landed);
          state_->pool.release(std::move(*h.buffer));
        }
      }
    }
  }

  void put(const StoreKey& key, std::vector<torch::Tensor> tensors) {
    std::vector<Held> items;
    for (auto& t : tensors) {
      Held h;
      if (t.defined() && t.device().type() == torch::kCPU) {
        h.tensor = t.detach();
      } else if (t.defined()) {
        const torch::Device device = t.device();
        const c10::Stream compute = current_stream(device);
        const torch::Tensor source = t.detach().contiguous();  // queued on the compute stream
        const c10::Stream out = state_->stream(device, /*to_host=*/true);
        wait_stream(out, compute);
        PinnedBuffer buffer = state_->pool.acquire(static_cast<std::int64_t>(source.nbytes()));
        h.tensor = buffer.bytes.view(source.scalar_type()).view(source.sizes());
        {
          c10::StreamGuard guard(out);
          h.tensor.copy_(source, /*non_blocking=*/true);
        }
        // `source` is dropped below; its block is not reused before the copy has read it.
        record_stream(source, out);
        h.landed.emplace(device.type());
        h.landed->record(out);
        h.buffer = std::move(buffer);
      }
      t = torch::Tensor();
      items.push_back(std::move(h));
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->held[{key.stage, key.micro}] = std::move(items);
  }

  std::vector<torch::Tensor> take(const StoreKey& key, const torch::Device& device) {
    std::vector<Held> items;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      auto it = state_->held.find({key.stage, key.micro});
      TORCH_CHECK(it != state_->held.end(), "stagewise::", describe(), ": stage ", key.stage,
                  " reloads micro-batch ", key.micro,
                  ", which it never offloaded; verify the plan (schedule::verify)");
      items = std::move(it->second);
      state_->held.erase(it);
    }
    std::vector<torch::Tensor> out;
    for (auto& h : items) {
      if (!h.buffer) {  // undefined, or a CPU stage's tensor kept as it was
        out.push_back(h.tensor.defined() ? copy_to(h.tensor, device) : h.tensor);
        continue;
      }
      const c10::Stream compute = current_stream(device);
      const c10::Stream in = state_->stream(device, /*to_host=*/false);
      h.landed->block(in);  // the offload's copy has filled the buffer
      torch::Tensor back =
          torch::empty(h.tensor.sizes(), h.tensor.options().device(device).pinned_memory(false));
      {
        c10::StreamGuard guard(in);
        back.copy_(h.tensor, /*non_blocking=*/true);
      }
      record_stream(back, in);
      c10::Event ready(device.type());
      ready.record(in);
      ready.block(compute);  // nothing on the compute stream reads it before it lands
      h.buffer->busy_until.emplace(std::move(ready));  // and the buffer waits for it too
      state_->pool.release(std::move(*h.buffer));
      out.push_back(std::move(back));
    }
    return out;
  }

  std::string describe() const { return "HostStore (pinned host memory)"; }

  /// A copy of the optimizer state kept for `key`, for the caller to change (none: not yet).
  std::optional<optim::StateRecord> read_state(const std::string& key) {
    optim::StateRecord kept;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      auto it = state_->kept_state.find(key);
      if (it == state_->kept_state.end()) return std::nullopt;
      kept = it->second;  // shares the tensors: copied below, outside the lock
    }
    optim::StateRecord out;
    out.step = kept.step;
    for (const auto& t : kept.tensors) {
      out.tensors.push_back(t.defined() ? t.clone() : torch::Tensor());
    }
    return out;
  }
  /// Stages `record` as `key`'s new state (host tensors, kept as they are) until commit_state.
  void write_state(const std::string& key, optim::StateRecord record) {
    for (auto& t : record.tensors) {
      TORCH_CHECK(!t.defined() || t.device().is_cpu(), "stagewise::", describe(),
                  ": optimizer state for '", key, "' on ", t.device(),
                  "; give it host (CPU) tensors");
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->staged_state[key] = std::move(record);
  }
  /// Makes every staged state the kept one (an empty record: none).
  void commit_state() {
    std::map<std::string, optim::StateRecord> staged, replaced;
    std::lock_guard<std::mutex> lock(state_->mutex);
    staged.swap(state_->staged_state);
    for (auto& [key, record] : staged) {
      auto& kept = state_->kept_state[key];
      replaced[key] = std::move(kept);  // freed once the lock is released
      if (record.empty()) {
        state_->kept_state.erase(key);
      } else {
        kept = std::move(record);
      }
    }
  }
  /// Drops every staged state; the kept ones stay as they were.
  void discard_state() {
    std::map<std::string, optim::StateRecord> dropped;
    std::lock_guard<std::mutex> lock(state_->mutex);
    dropped.swap(state_->staged_state);
  }

  /// Pinned buffers allocated so far and their bytes: after the first step, a step like it
  /// allocates none.
  std::int64_t pinned_allocations() const { return state_->pool.allocations(); }
  std::int64_t pinned_bytes() const { return state_->pool.bytes(); }

 private:
  using PinnedBuffer = detail::PinnedBuffer;
  struct Held {
    torch::Tensor tensor;                // on the host
    std::optional<PinnedBuffer> buffer;  // the pinned buffer behind it (GPU stages)
    std::optional<c10::Event> landed;    // the device-to-host copy's end
  };
  struct State {
    std::mutex mutex;
    std::map<std::pair<int, int>, std::vector<Held>> held;
    std::map<std::string, optim::StateRecord> kept_state, staged_state;  // optimizer state
    detail::PinnedPool pool;
    std::map<std::pair<int, bool>, c10::Stream> streams;  // (device index, to host) -> stream

    c10::Stream stream(const torch::Device& device, bool to_host) {
      std::lock_guard<std::mutex> lock(mutex);
      const std::pair<int, bool> k{device.index(), to_host};
      auto it = streams.find(k);
      if (it == streams.end()) it = streams.emplace(k, new_stream(device)).first;
      return it->second;
    }
  };
  std::shared_ptr<State> state_;
};

static_assert(offload_store<HostStore>);
static_assert(state_store<HostStore>);

}  // namespace stagewise::runtime
