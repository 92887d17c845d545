#pragma once

// One block of examples/gpt's transformer as a module of its own, for measuring what a pipeline
// cell of a transformer keeps (benchmarks/schedules.cpp, tests/bench): gpt::BlockImpl's forward
// (pre-norm causal attention with RoPE and an MLP with GELU, each after an RMSNorm, each with a
// residual), built from the example's own RMSNorm, Attention and Mlp, with the RoPE tables and the
// causal mask as the block's buffers instead of skips from the embedding. The ids are one document
// of ones made per call (gpt::document_mask then gives the causal mask), so that the block
// allocates what the example's block does, [b, 1, T, T] mask included.

#include "examples/gpt/model.hpp"

#include <torch/torch.h>

#include <cstdint>

namespace stagewise::bench {

/// examples/gpt's block with its RoPE tables and causal mask as buffers: input and output
/// [b, T, dim] with T up to `c.context`.
///   auto block = stagewise::bench::GptBlock(gpt::Config{.dim = 256, .heads = 4, .context = 512});
struct GptBlockImpl : torch::nn::Module {
  explicit GptBlockImpl(const gpt::Config& c)
      : norm1(register_module("norm1", gpt::RMSNorm(c.dim))),
        attn(register_module("attn", gpt::Attention(c))),
        norm2(register_module("norm2", gpt::RMSNorm(c.dim))),
        mlp(register_module("mlp", gpt::Mlp(c))) {
    const int64_t half = c.head_dim() / 2;
    auto inv_freq = torch::pow(c.rope_base, -torch::arange(half, torch::kDouble) / double(half));
    auto angles = torch::outer(torch::arange(c.context, torch::kDouble), inv_freq);
    cos = register_buffer("rope_cos", angles.cos().to(torch::kFloat));
    sin = register_buffer("rope_sin", angles.sin().to(torch::kFloat));
    causal = register_buffer("causal_mask",
                             torch::ones({c.context, c.context}, torch::kBool).tril());
  }
  /// gpt::BlockImpl::forward on `x` [b, T, dim].
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1);
    auto ids = torch::ones({b, t}, torch::kLong);
    auto mask = gpt::document_mask(causal.narrow(0, 0, t).narrow(1, 0, t), ids);
    x = x + attn(norm1(x), cos.narrow(0, 0, t).to(x.dtype()), sin.narrow(0, 0, t).to(x.dtype()),
                 mask);
    return x + mlp(norm2(x));
  }
  gpt::RMSNorm norm1;
  gpt::Attention attn;
  gpt::RMSNorm norm2;
  gpt::Mlp mlp;
  torch::Tensor cos, sin, causal;
};
TORCH_MODULE(GptBlock);

/// `blocks` GptBlocks in a Sequential (seeded: the same weights every call), for a pipe to split.
///   auto seq = stagewise::bench::gpt_blocks(config, 8);
inline torch::nn::Sequential gpt_blocks(const gpt::Config& c, int blocks) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < blocks; ++i) seq->push_back(GptBlock(c));
  return seq;
}

}  // namespace stagewise::bench
