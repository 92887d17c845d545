#pragma once

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace stagewise {

/// Which micro-batches keep only their input and recompute their activations in backward.
enum class Checkpoint {
  always,       ///< every micro-batch: least memory, one extra forward per cell
  except_last,  ///< all but the last micro-batch, whose backward starts at once (the default)
  never,        ///< none: fastest, every activation is kept
};

/// Parses "always", "except_last" or "never".
inline Checkpoint checkpoint_mode(std::string_view name) {
  if (name == "always") return Checkpoint::always;
  if (name == "except_last") return Checkpoint::except_last;
  if (name == "never") return Checkpoint::never;
  TORCH_CHECK(false, "stagewise: unknown checkpoint mode '", std::string(name),
              "'; use \"always\", \"except_last\" or \"never\"");
}

inline const char* to_string(Checkpoint mode) {
  switch (mode) {
    case Checkpoint::always: return "always";
    case Checkpoint::except_last: return "except_last";
    case Checkpoint::never: return "never";
  }
  TORCH_CHECK(false, "stagewise: unknown checkpoint mode ", static_cast<int>(mode),
              "; use Checkpoint::always, Checkpoint::except_last or Checkpoint::never");
}

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
