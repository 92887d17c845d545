// What a cell waiting for its W holds, counted by the counting allocator: what W reads (each
// weight's input and the gradient of its output, as I kept it) within 10%, and no more: on an MLP
// stage, whose forward keeps just that, and on examples/gpt's transformer block, whose forward
// keeps far more (attention's probabilities, the norms' and GELU's inputs) that only I reads and
// that I frees as it goes.
#include "benchmarks/common/gpt_block.hpp"
#include "benchmarks/common/memory.hpp"

#include <stagewise/runtime/split_backward.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

namespace sw = stagewise;
using Keep = sw::runtime::SplitBackward::Keep;

namespace {

// What one cell of `stage` (micro-batch of shape `shape`, not its first stage: its input needs
// a gradient) allocates: `held`, what is still held after its I, the output and the input's
// gradient dropped as the pipe drops them; `i_peak`, the most held while I ran; `b_peak`, the
// most held while a whole backward ran instead. The stage's input and the output's gradient were
// there before the cell (the previous stage's output, the next stage's message).
struct CellUse {
  double held = 0, i_peak = 0, b_peak = 0;
};

CellUse cell_use(torch::nn::Sequential stage, const std::vector<std::int64_t>& shape, Keep keep) {
  auto& memory = sw::bench::counting_allocator();
  const auto x = torch::randn(shape);
  const auto g = torch::randn(shape);
  stage->forward(x).backward(g);  // the gradients exist, as after a pipe's first step
  const long long before = memory.current();
  CellUse use;
  {
    auto y = stage->forward(x.detach().requires_grad_());
    memory.reset_peak();
    y.backward(g);
    use.b_peak = static_cast<double>(memory.peak() - before);
  }
  auto leaf = x.detach().requires_grad_();
  sw::runtime::SplitBackward split(keep);
  {
    auto y = stage->forward(leaf);
    memory.reset_peak();
    auto dx = split.input_grad({y}, {g}, {leaf});
    use.i_peak = static_cast<double>(memory.peak() - before);
    REQUIRE(dx[0].defined());
  }
  use.held = static_cast<double>(memory.current() - before);
  split.weight_grad();
  CHECK(memory.current() == before);  // W frees the cell
  return use;
}

}  // namespace

TEST_SUITE("split backward memory") {
  TEST_CASE("an MLP cell waiting for its W holds its layers' inputs and output gradients") {
    sw::bench::counting_allocator();
    torch::manual_seed(0);
    constexpr std::int64_t rows = 64, width = 16, hidden = 256;
    torch::nn::Sequential stage;
    for (int i = 0; i < 2; ++i) {
      stage->push_back(torch::nn::Linear(width, hidden));
      stage->push_back(torch::nn::ReLU());
      stage->push_back(torch::nn::Linear(hidden, width));
    }
    // W reads, per block: the ReLU's output (the second Linear's input) and the gradient of the
    // first Linear's output; between the blocks, the first block's output (the next Linear's
    // input) and its gradient. The last Linear's output gradient is the message's.
    const double reads = 4.0 * rows * (2 * (hidden + hidden) + (width + width));
    const double held = cell_use(stage, {rows, width}, Keep::what_w_reads).held;
    const double whole = cell_use(stage, {rows, width}, Keep::whole_graph).held;
    MESSAGE("MLP cell after I: " << held << " bytes, W reads " << reads << "; whole graph "
                                 << whole);
    CHECK(held >= 0.9 * reads);
    CHECK(held <= 1.1 * reads);
    // Its forward kept W's inputs already: keeping the whole graph adds only the output.
    CHECK(whole - held == doctest::Approx(4.0 * rows * width));
  }

  TEST_CASE("a transformer block's cell waiting for its W holds what W reads, attention freed") {
    sw::bench::counting_allocator();
    gpt::Config c;
    c.dim = 32;
    c.heads = 2;
    c.context = 64;
    const std::int64_t b = 2;
    auto stage = sw::bench::gpt_blocks(c, 1);
    // In [b, T, dim] activations: each RMSNorm's scale by its weight reads x * rsqrt(...) and its
    // output gradient (1 + 1, twice); qkv reads the first norm's output and the gradient of its
    // [b, T, 3 dim] output (1 + 3); proj the attention's output and its gradient (1 + 1); the
    // MLP's fc the second norm's output and its [b, T, 4 dim] gradient (1 + 4) and its out the
    // GELU's [b, T, 4 dim] output (4; its output gradient is the message's).
    const double activation = 4.0 * b * c.context * c.dim;
    const double reads = activation * (2 * 2 + 4 + 2 + 5 + 4);
    const auto use = cell_use(stage, {b, c.context, c.dim}, Keep::what_w_reads);
    const auto kept = cell_use(stage, {b, c.context, c.dim}, Keep::whole_graph);
    const double held = use.held, whole = kept.held;
    MESSAGE("GPT block cell after I: " << held << " bytes, W reads " << reads << "; whole graph "
                                       << whole << "; peak in I " << use.i_peak << " (whole graph "
                                       << kept.i_peak << "), in a whole backward " << use.b_peak);
    CHECK(held >= 0.9 * reads);
    CHECK(held <= 1.1 * reads);
    // The probabilities alone ([b, heads, T, T]) are 4 activations here: the release frees them,
    // the softmax's and the scores' inputs, the norms' and the GELU's inputs, the queries and keys.
    CHECK(whole - held >= 4.0 * b * c.heads * c.context * c.context);
    // I frees as it goes, as a whole backward does: its peak exceeds a whole backward's by at
    // most the output gradients it keeps for W (1 + 1 + 3 + 1 + 1 + 4 activations); holding every
    // saved tensor until its end, it would not stay within that.
    const double kept_grads = activation * (1 + 1 + 3 + 1 + 1 + 4);
    CHECK(use.i_peak <= use.b_peak + kept_grads);
    CHECK(kept.i_peak > use.b_peak + kept_grads);
  }
}
