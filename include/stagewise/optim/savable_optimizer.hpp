#pragma once

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace stagewise {

/// An optimizer whose state a pipe's save keeps and its load restores: any LibTorch optimizer
/// (`torch::optim::Adam`, `SGD`, ...) and `optim::FusedStep`.
///   pipe->save(dir, optimizer, step);   // optimizer: savable_optimizer
template <class O>
concept savable_optimizer = requires(const O& saved, O& loaded,
                                     torch::serialize::OutputArchive& out,
                                     torch::serialize::InputArchive& in) {
  saved.save(out);
  loaded.load(in);
};

}  // namespace stagewise
