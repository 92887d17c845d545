#pragma once

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/schedule/offload.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace stagewise {

/// Options of a Pipe, as chained setters in LibTorch's style.
///   stagewise::PipeOptions().chunks(8).checkpoint(stagewise::Checkpoint::except_last)
class PipeOptions {
 public:
  /// Number of micro-batches a mini-batch is split into (> 0; default 1).
  PipeOptions& chunks(int64_t n) {
    TORCH_CHECK(n > 0, "stagewise::PipeOptions: chunks must be positive, got ", n,
                "; use chunks(1) to run the mini-batch whole");
    chunks_ = n;
    return *this;
  }
  /// Checkpointing mode (default except_last).
  PipeOptions& checkpoint(Checkpoint mode) {
    (void)to_string(mode);  // rejects values outside the enum
    checkpoint_ = mode;
    return *this;
  }
  /// Checkpointing mode by name: "always", "except_last" or "never".
  PipeOptions& checkpoint(std::string_view mode) { return checkpoint(checkpoint_mode(mode)); }
  /// One device per stage, in order (devices may repeat; default: every stage on the CPU).
  PipeOptions& devices(std::vector<torch::Device> devices) {
    devices_ = std::move(devices);
    return *this;
  }

  /// Deferred batch norm (default off): when the Pipe is built from a Sequential, every
  /// BatchNorm1d/2d/3d with running statistics becomes a `DeferredBatchNorm` sharing its
  /// parameters and buffers, whose running mean and variance are updated once per mini-batch, as
  /// plain batch norm over the whole mini-batch would (see docs/pipe.md).
  ///   stagewise::PipeOptions().chunks(4).deferred_batch_norm(true)
  PipeOptions& deferred_batch_norm(bool on) {
    deferred_batch_norm_ = on;
    return *this;
  }

  /// Activation offload (default off): in `train_step`, what each checkpointed cell keeps (its
  /// inputs and the skips it popped) goes to `store` after its forward and comes back before its
  /// recompute, as offload O and reload L actions that `schedule::offload` places in the plan
  /// from `costs`: only where the forward-to-backward gap hides `costs.round_trips` copies. With
  /// `costs.stages` empty every stage but the first offloads (the caller's batch holds the
  /// first's inputs anyway). Results are bit-identical to the same pipe without offload. Only
  /// checkpointed cells offload: pair it with Checkpoint::always (or except_last). See
  /// docs/memory.md.
  ///   stagewise::PipeOptions().chunks(8).checkpoint("always")
  ///       .offload(stagewise::runtime::FileStore("/nvme/offload"))
  PipeOptions& offload(runtime::AnyStore store, schedule::OffloadCosts costs = {}) {
    TORCH_CHECK(costs.round_trips >= 0.0, "stagewise::PipeOptions: offload's round_trips is ",
                costs.round_trips, "; give 0 or more (3: a pair must hide three copies)");
    offload_store_ = std::move(store);
    offload_costs_ = std::move(costs);
    return *this;
  }

  int64_t chunks() const { return chunks_; }
  const std::optional<runtime::AnyStore>& offload_store() const { return offload_store_; }
  const schedule::OffloadCosts& offload_costs() const { return offload_costs_; }
  Checkpoint checkpoint() const { return checkpoint_; }
  const std::vector<torch::Device>& devices() const { return devices_; }
  bool deferred_batch_norm() const { return deferred_batch_norm_; }

 private:
  int64_t chunks_ = 1;
  Checkpoint checkpoint_ = Checkpoint::except_last;
  std::vector<torch::Device> devices_;
  bool deferred_batch_norm_ = false;
  std::optional<runtime::AnyStore> offload_store_;
  schedule::OffloadCosts offload_costs_;
};

}  // namespace stagewise
