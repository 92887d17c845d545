#pragma once

#include "stagewise/core/checkpoint_state.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/functional/batchnorm.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

namespace stagewise {

/// Batch norm for pipelines: in training each micro-batch is normalised with its own statistics
/// (as plain batch norm run chunk by chunk would), but the running mean and variance are updated
/// once per mini-batch, from the statistics of all its micro-batches together, so they equal plain
/// batch norm's over the whole mini-batch. Micro-batches seen while a checkpointed stage is
/// recomputed (`is_recomputing()`) are not counted twice. In eval it is plain batch norm.
///
/// The mini-batch ends after `micro_batches` micro-batches: `chunks` from the constructor, or the
/// number a `Pipe` announces through `begin_mini_batch` before each forward and train_step (so a
/// batch smaller than `chunks`, which splits into fewer micro-batches, still commits its
/// statistics at its end). Usually made for you: `PipeOptions().deferred_batch_norm(true)` or
/// `convert_deferred_batch_norm(seq, chunks)`.
///   stagewise::DeferredBatchNorm bn(2, torch::nn::BatchNormOptions(16), /*chunks=*/4);
class DeferredBatchNormImpl : public torch::nn::Module {
 public:
  /// A new batch norm over inputs with `spatial_dims` dimensions after the channels (1 for
  /// BatchNorm1d, 2 for BatchNorm2d, 3 for BatchNorm3d), committing every `chunks` micro-batches.
  DeferredBatchNormImpl(int64_t spatial_dims, torch::nn::BatchNormOptions options,
                        int64_t chunks = 1)
      : torch::nn::Module("stagewise::DeferredBatchNorm"),
        options(std::move(options)),
        spatial_dims_(spatial_dims),
        chunks_(chunks) {
    TORCH_CHECK(spatial_dims >= 1 && spatial_dims <= 3,
                "stagewise::DeferredBatchNorm: spatial_dims must be 1, 2 or 3 (BatchNorm1d, 2d or "
                "3d), got ",
                spatial_dims);
    TORCH_CHECK(chunks >= 1, "stagewise::DeferredBatchNorm: chunks must be positive, got ", chunks,
                "; give the number of micro-batches per mini-batch (PipeOptions().chunks())");
    const int64_t c = this->options.num_features();
    adopt(this->options.affine() ? torch::ones({c}) : torch::Tensor(),
          this->options.affine() ? torch::zeros({c}) : torch::Tensor(), torch::zeros({c}),
          torch::ones({c}), torch::tensor(0, torch::kLong));
  }

  /// A deferred twin of `bn` (a BatchNorm1d/2d/3d) that shares its parameters and buffers: its
  /// updates of the running statistics are the original's.
  ///   stagewise::DeferredBatchNorm deferred(*bn2d, /*chunks=*/8);
  template <std::size_t D, class Derived>
  DeferredBatchNormImpl(const torch::nn::BatchNormImplBase<D, Derived>& bn, int64_t chunks)
      : torch::nn::Module("stagewise::DeferredBatchNorm"),
        options(bn.options),
        spatial_dims_(static_cast<int64_t>(D)),
        chunks_(chunks) {
    TORCH_CHECK(chunks >= 1, "stagewise::DeferredBatchNorm: chunks must be positive, got ", chunks,
                "; give the number of micro-batches per mini-batch (PipeOptions().chunks())");
    TORCH_CHECK(bn.options.track_running_stats(),
                "stagewise::DeferredBatchNorm: the batch norm has no running statistics "
                "(track_running_stats(false)); it needs no deferring, keep it as it is");
    adopt(bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked);
  }

  /// Normalises `input` (N, C, ...) with its own statistics in training, with the running ones in
  /// eval; in training, also counts its statistics towards this mini-batch's running update.
  torch::Tensor forward(const torch::Tensor& input) {
    TORCH_CHECK(input.dim() == spatial_dims_ + 2 || (spatial_dims_ == 1 && input.dim() == 2),
                "stagewise::DeferredBatchNorm: expected a ",
                spatial_dims_ == 1 ? "2D or 3D" : std::to_string(spatial_dims_ + 2) + "D",
                " input (like BatchNorm", spatial_dims_, "d), got ", input.dim(), "D");
    const bool tracking = options.track_running_stats();
    if (!is_training() && tracking) {
      return torch::nn::functional::detail::batch_norm(input, running_mean, running_var, weight,
                                                       bias, false, 0.0, options.eps());
    }
    auto out = torch::nn::functional::detail::batch_norm(input, torch::Tensor(), torch::Tensor(),
                                                         weight, bias, true, 0.0, options.eps());
    if (is_training() && tracking && !is_recomputing()) track(input);
    return out;
  }

  /// Starts a new mini-batch of `micro_batches` micro-batches: statistics gathered so far and not
  /// committed are dropped, and the running statistics are updated after the `micro_batches`-th
  /// micro-batch. A Pipe calls it before each forward and train_step.
  void begin_mini_batch(int64_t micro_batches) {
    TORCH_CHECK(micro_batches >= 1,
                "stagewise::DeferredBatchNorm::begin_mini_batch: a mini-batch has at least one "
                "micro-batch, got ",
                micro_batches);
    std::lock_guard<std::mutex> lock(mutex_);
    expected_ = micro_batches;
    clear_sums();
  }

  /// Micro-batches counted in the current mini-batch and not committed yet.
  int64_t pending_micro_batches() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return tracked_;
  }

  /// Micro-batches per mini-batch when no Pipe announces them (the constructor's `chunks`).
  int64_t chunks() const { return chunks_; }
  /// 1, 2 or 3: the BatchNorm1d/2d/3d this module stands for.
  int64_t spatial_dims() const { return spatial_dims_; }

  /// A deep copy (its own parameters and buffers, none shared), on `device` if given.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override {
    auto copy = std::make_shared<DeferredBatchNormImpl>(spatial_dims_, options, chunks_);
    const auto copy_of = [&](const torch::Tensor& t) {
      if (!t.defined()) return t;
      torch::NoGradGuard no_grad;
      auto c = device ? t.to(*device, /*non_blocking=*/false, /*copy=*/true) : t.clone();
      return c.set_requires_grad(t.requires_grad());
    };
    copy->adopt(copy_of(weight), copy_of(bias), copy_of(running_mean), copy_of(running_var),
                copy_of(num_batches_tracked), /*replace=*/true);
    copy->train(is_training());
    return copy;
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "stagewise::DeferredBatchNorm" << spatial_dims_ << "d(" << options.num_features()
           << ", eps=" << options.eps() << ", chunks=" << chunks_ << ")";
  }

  torch::nn::BatchNormOptions options;
  torch::Tensor weight;
  torch::Tensor bias;
  torch::Tensor running_mean;
  torch::Tensor running_var;
  torch::Tensor num_batches_tracked;

 private:
  void adopt(torch::Tensor w, torch::Tensor b, torch::Tensor mean, torch::Tensor var,
             torch::Tensor batches, bool replace = false) {
    if (replace) {
      // Only clone() replaces: the fresh tensors of the constructor give way to the copies.
      parameters_["weight"] = w;
      parameters_["bias"] = b;
      running_mean.set_data(mean);
      running_var.set_data(var);
      num_batches_tracked.set_data(batches);
      weight = w;
      bias = b;
      return;
    }
    weight = register_parameter("weight", w, /*requires_grad=*/w.defined() && w.requires_grad());
    bias = register_parameter("bias", b, /*requires_grad=*/b.defined() && b.requires_grad());
    running_mean = register_buffer("running_mean", mean);
    running_var = register_buffer("running_var", var);
    num_batches_tracked = register_buffer("num_batches_tracked", batches);
  }

  void clear_sums() {
    tracked_ = 0;
    count_ = 0;
    mean_ = torch::Tensor();
    m2_ = torch::Tensor();
  }

  // Adds one micro-batch's mean and sum of squared deviations to the mini-batch's (in double,
  // merged with Chan's parallel formula, which stays exact where sum-of-squares would cancel).
  void track(const torch::Tensor& input) {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
    const auto x = input.detach().to(torch::kDouble);
    const auto mean = x.mean(dims);
    auto shape = std::vector<int64_t>(static_cast<std::size_t>(input.dim()), 1);
    shape[1] = input.size(1);
    const auto m2 = (x - mean.view(shape)).square().sum(dims);
    const int64_t n = input.numel() / input.size(1);

    std::lock_guard<std::mutex> lock(mutex_);
    if (count_ == 0) {
      mean_ = mean;
      m2_ = m2;
    } else {
      const double total = static_cast<double>(count_ + n);
      const auto delta = mean - mean_;
      mean_ = mean_ + delta * (static_cast<double>(n) / total);
      m2_ = m2_ + m2 + delta.square() * (static_cast<double>(count_) * n / total);
    }
    count_ += n;
    if (++tracked_ >= expected_) commit();
  }

  // The update plain batch norm makes once over the whole mini-batch.
  void commit() {
    num_batches_tracked.add_(1);
    const double factor = options.momentum().has_value() ? *options.momentum()
                                                         : 1.0 / num_batches_tracked.item<double>();
    const auto var = count_ > 1 ? m2_ / static_cast<double>(count_ - 1) : m2_;
    running_mean.mul_(1.0 - factor).add_(mean_.to(running_mean.dtype()), factor);
    running_var.mul_(1.0 - factor).add_(var.to(running_var.dtype()), factor);
    expected_ = chunks_;
    clear_sums();
  }

  int64_t spatial_dims_;
  int64_t chunks_;
  mutable std::mutex mutex_;
  int64_t expected_ = chunks_;
  int64_t tracked_ = 0;
  int64_t count_ = 0;
  torch::Tensor mean_;
  torch::Tensor m2_;
};

/// A module holder for DeferredBatchNormImpl.
TORCH_MODULE(DeferredBatchNorm);

}  // namespace stagewise
