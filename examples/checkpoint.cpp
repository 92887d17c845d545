// checkpoint: activation checkpointing for any LibTorch code, no pipeline needed.
//   ./bazelw run //examples:checkpoint
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/memory.hpp"

#include <iostream>
#include <vector>

namespace sw = stagewise;

int main() {
  auto& memory = sw::bench::counting_allocator();  // counts the bytes of tensor memory
  torch::manual_seed(0);

  // A deep stack of blocks; each block's activations are what checkpointing saves. With a large
  // batch they dominate the peak, as in most training (the gradients are the same both ways).
  std::vector<torch::nn::Sequential> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.emplace_back(torch::nn::Linear(256, 1024), torch::nn::GELU(), torch::nn::Dropout(0.1),
                        torch::nn::Linear(1024, 256));
  }
  auto x = torch::randn({1024, 256}, torch::requires_grad());

  auto run = [&](bool checkpointed) {
    memory.reset_peak();
    const long long base = memory.current();
    torch::manual_seed(1);  // same dropout masks both times
    auto h = x;
    for (auto& block : blocks) {
      auto f = [&](const torch::Tensor& in) { return in + block->forward(in); };
      // The only change: wrap the block. Its activations are recomputed in backward, with the
      // same dropout mask, instead of being kept.
      h = checkpointed ? sw::checkpoint(f, h) : f(h);
    }
    h.pow(2).mean().backward();
    const double peak_mib = double(memory.peak() - base) / (1 << 20);
    auto grad = x.grad().clone();
    x.mutable_grad().reset();
    // Frees the gradients (LibTorch 2.x's default; 1.x kept them, zeroed), so each run allocates
    // its own and the two peaks compare like for like.
    for (auto& block : blocks) block->zero_grad(/*set_to_none=*/true);
    return std::make_pair(peak_mib, grad);
  };

  auto [plain_peak, plain_grad] = run(false);
  auto [ckpt_peak, ckpt_grad] = run(true);
  std::cout << "peak tensor memory: plain " << plain_peak << " MiB, checkpointed " << ckpt_peak
            << " MiB (" << ckpt_peak / plain_peak << "x)\n";
  const bool same = ckpt_grad.equal(plain_grad);
  std::cout << "input gradient identical (dropout replayed): " << (same ? "yes" : "NO") << "\n";
  return same && ckpt_peak < plain_peak ? 0 : 1;
}
