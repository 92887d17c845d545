#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/stage/block_partition.hpp"
#include "stagewise/stage/partition.hpp"
#include "stagewise/stage/profile.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace stagewise {

namespace detail {
inline void check_partitions(int64_t partitions, const torch::nn::Sequential& model,
                             const char* who) {
  TORCH_CHECK(partitions >= 1, who, ": partitions must be at least 1, got ", partitions,
              "; ask for one partition per pipeline stage");
  const auto layers = static_cast<int64_t>(model->size());
  TORCH_CHECK(layers >= partitions, who, ": cannot split ", layers, " layers into ", partitions,
              " partitions; every stage needs a layer, so use at most ", layers,
              " partitions (or split the model into more layers)");
}

inline balance balance_of(const std::vector<double>& costs, int64_t partitions) {
  const auto sizes = block_sizes(costs, partitions);
  return balance(sizes.begin(), sizes.end());
}
}  // namespace detail

/// The balance (layers per stage) that makes the slowest of `partitions` stages as fast as
/// possible: each layer's forward + backward time is measured on copies (`profile_times`), then
/// the exact min-max split is solved (`block_sizes`). `sample` is one micro-batch, like those the
/// pipe will run. The model is left as it was; a parameter with a gradient is an error.
///   auto b = stagewise::balance_by_time(2, model, torch::randn({32, 256}));
///   auto pipe = stagewise::Pipe(model, b, stagewise::PipeOptions().chunks(8));
inline balance balance_by_time(int64_t partitions, const torch::nn::Sequential& model,
                               const Batch& sample, const BalanceOptions& options = {}) {
  detail::check_partitions(partitions, model, "stagewise::balance_by_time");
  return detail::balance_of(profile_times(model, sample, options), partitions);
}

/// The balance that makes the largest of `partitions` stages' memory as small as possible: each
/// layer's activation memory on `sample` plus `param_scale` times its parameters
/// (`profile_sizes`), split exactly. Use it when memory, not time, limits the pipeline.
///   auto b = stagewise::balance_by_size(4, model, torch::randn({8, 3, 224, 224}),
///                                       stagewise::BalanceOptions().param_scale(4));  // Adam
inline balance balance_by_size(int64_t partitions, const torch::nn::Sequential& model,
                               const Batch& sample, const BalanceOptions& options = {}) {
  detail::check_partitions(partitions, model, "stagewise::balance_by_size");
  return detail::balance_of(profile_sizes(model, sample, options), partitions);
}

}  // namespace stagewise
