#pragma once

#include "stagewise/nn/deferred_batch_norm.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>

namespace stagewise {

namespace detail {
// The batch norm behind `m` as a DeferredBatchNorm sharing its tensors, or nullptr when `m` is
// not a BatchNorm1d/2d/3d with running statistics.
inline std::shared_ptr<DeferredBatchNormImpl> deferred_twin(const torch::nn::Module& m,
                                                            int64_t chunks) {
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m)) {
    if (bn->options.track_running_stats()) {
      return std::make_shared<DeferredBatchNormImpl>(*bn, chunks);
    }
  } else if (const auto* bn2 = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m)) {
    if (bn2->options.track_running_stats()) {
      return std::make_shared<DeferredBatchNormImpl>(*bn2, chunks);
    }
  } else if (const auto* bn3 = dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m)) {
    if (bn3->options.track_running_stats()) {
      return std::make_shared<DeferredBatchNormImpl>(*bn3, chunks);
    }
  }
  return nullptr;
}

// Fails when a batch norm with running statistics sits where it cannot be swapped: inside a
// layer (a C++ module calls its members directly).
inline void refuse_hidden_batch_norm(const torch::nn::Module& root, const std::string& where) {
  for (const auto& item : root.named_modules()) {
    TORCH_CHECK(!deferred_twin(*item.value(), 1),
                "stagewise: deferred batch norm cannot reach the batch norm '",
                item.key().empty() ? where : where + "." + item.key(), "' (", item.value()->name(),
                "): it sits inside a module whose forward calls it directly. Build that module "
                "with stagewise::DeferredBatchNorm in its "
                "place, or turn deferred_batch_norm off.");
  }
}
}  // namespace detail

/// A copy of the Sequential `seq` (the same layer objects, in the same order and under the same
/// names) in which every BatchNorm1d/2d/3d with running statistics among its layers is replaced
/// by a `DeferredBatchNorm` that shares its parameters and buffers and
/// commits its running statistics every `chunks` micro-batches. `seq` itself is not changed. A
/// batch norm hidden inside another module type is an error (swap it there by hand).
/// `PipeOptions().deferred_batch_norm(true)` does this when the Pipe is built.
///   auto deferred = stagewise::convert_deferred_batch_norm(model, /*chunks=*/4);
inline torch::nn::Sequential convert_deferred_batch_norm(const torch::nn::Sequential& seq,
                                                         int64_t chunks) {
  TORCH_CHECK(chunks >= 1, "stagewise::convert_deferred_batch_norm: chunks must be positive, got ",
              chunks, "; give the number of micro-batches per mini-batch");
  torch::nn::Sequential out;
  const auto children = seq->named_children();
  for (std::size_t i = 0; i < seq->size(); ++i) {
    const auto& name = children[i].key();
    const auto& child = children[i].value();
    if (auto twin = detail::deferred_twin(*child, chunks)) {
      out->push_back(name, torch::nn::AnyModule(DeferredBatchNorm(twin)));
    } else {
      detail::refuse_hidden_batch_norm(*child, name);
      out->push_back(name, *(seq->begin() + static_cast<std::ptrdiff_t>(i)));
    }
  }
  return out;
}

}  // namespace stagewise
