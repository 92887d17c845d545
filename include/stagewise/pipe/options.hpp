#pragma once

#include "stagewise/core/checkpoint_mode.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstdint>
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

  int64_t chunks() const { return chunks_; }
  Checkpoint checkpoint() const { return checkpoint_; }
  const std::vector<torch::Device>& devices() const { return devices_; }
  bool deferred_batch_norm() const { return deferred_batch_norm_; }

 private:
  int64_t chunks_ = 1;
  Checkpoint checkpoint_ = Checkpoint::except_last;
  std::vector<torch::Device> devices_;
  bool deferred_batch_norm_ = false;
};

}  // namespace stagewise
