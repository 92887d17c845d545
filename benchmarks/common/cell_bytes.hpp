#pragma once

// What one cell (micro-batch, stage) of a pipeline keeps and works with, measured on one stage
// alone with the counting allocator: the numbers schedule::peak_bytes turns into each worker's
// predicted peak (see tests/bench/memory_model_test.cpp and benchmarks/schedules.cpp).

#include "benchmarks/common/memory.hpp"

#include <stagewise/runtime/split_backward.hpp>
#include <stagewise/schedule/simulate.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace stagewise::bench {

/// The CellBytes of `stage` on micro-batches of shape `shape` (output of the same shape;
/// checkpoint never), with the stage's parameters' gradients already there, as in a pipe after
/// its first step. `split_backward`: the schedule splits backwards into I and W (the split keeps
/// what `SplitBackward::default_keep()` says between them). `first`: the first stage, whose
/// micro-batch needs no gradient, so that its I has nothing to do and its W runs the whole
/// backward. `last`: the last stage, whose backward starts from the loss (mean squared error).
///   auto b = stagewise::bench::cell_bytes(block, {2, 512, 256}, false, false, true);
inline schedule::CellBytes cell_bytes(torch::nn::Sequential stage,
                                      const std::vector<std::int64_t>& shape, bool first,
                                      bool last, bool split_backward) {
  auto forward = [&](const torch::Tensor& in) { return stage->forward(in); };
  auto& memory = counting_allocator();
  auto x = torch::randn(shape);
  auto t = torch::randn(shape);
  auto g = torch::randn(shape);
  auto backward = [&](const torch::Tensor& y) {
    if (last) {
      torch::mse_loss(y, t).backward();
    } else {
      y.backward(g);
    }
  };
  backward(forward(x));  // the gradients exist
  schedule::CellBytes c;
  const long long before = memory.current();
  double whole_working = 0;
  {
    // Kept from F to the backward, and a whole backward's working memory.
    auto y = forward(x);
    c.forward = static_cast<double>(memory.current() - before);
    memory.reset_peak();
    backward(y);
    whole_working = static_cast<double>(memory.peak() - before) - c.forward;
  }
  if (!split_backward) {
    c.working = whole_working;
    return c;
  }
  // The gradient a cell receives from the next stage stays with it until its W (W starts from
  // it), where a device would hold it: counted as the cell's from its I on.
  const double received = last ? 0.0 : static_cast<double>(g.nbytes());
  if (first) {
    c.input_grad = c.forward + received;
    c.weight_working = whole_working;
    return c;
  }
  // I keeps what W needs (each layer's input and output gradient); W then works on top of it.
  auto leaf = x.detach().requires_grad_();
  auto y = forward(leaf);
  const double kept = static_cast<double>(memory.current() - before);
  memory.reset_peak();
  runtime::SplitBackward split;
  if (last) {
    auto loss = torch::mse_loss(y, t);
    split.input_grad({loss}, {torch::ones_like(loss)}, {leaf});
  } else {
    auto received_g = g.clone();
    split.input_grad({y}, {received_g}, {leaf});
  }
  c.working = static_cast<double>(memory.peak() - before) - kept;
  y = torch::Tensor();
  leaf = torch::Tensor();
  c.input_grad = static_cast<double>(memory.current() - before);
  memory.reset_peak();
  split.weight_grad();
  c.weight_working = static_cast<double>(memory.peak() - before) - c.input_grad;
  return c;
}

/// cell_bytes on micro-batches of `rows` x `width`.
///   auto b = stagewise::bench::cell_bytes(stage, 64, 16, false, false, true);
inline schedule::CellBytes cell_bytes(torch::nn::Sequential stage, std::int64_t rows,
                                      std::int64_t width, bool first, bool last,
                                      bool split_backward) {
  return cell_bytes(std::move(stage), {rows, width}, first, last, split_backward);
}

/// The CellBytes of every stage of a pipe of `stages` stages built alike (`make_stage()` makes
/// one) on micro-batches of shape `shape`, first and last stage measured as such: what
/// schedule::peak_bytes takes.
///   auto bytes = stagewise::bench::stage_cell_bytes(make, 8, {2, 512, 256}, true);
template <class MakeStage>
std::vector<schedule::CellBytes> stage_cell_bytes(const MakeStage& make_stage, int stages,
                                                  const std::vector<std::int64_t>& shape,
                                                  bool split_backward) {
  std::vector<schedule::CellBytes> out;
  for (int j = 0; j < stages; ++j) {
    out.push_back(cell_bytes(make_stage(), shape, j == 0, j == stages - 1, split_backward));
  }
  return out;
}

/// stage_cell_bytes on micro-batches of `rows` x `width`.
///   auto bytes = stagewise::bench::stage_cell_bytes([] { return block(); }, 8, 64, 16, true);
template <class MakeStage>
std::vector<schedule::CellBytes> stage_cell_bytes(const MakeStage& make_stage, int stages,
                                                  std::int64_t rows, std::int64_t width,
                                                  bool split_backward) {
  return stage_cell_bytes(make_stage, stages, std::vector<std::int64_t>{rows, width},
                          split_backward);
}

}  // namespace stagewise::bench
