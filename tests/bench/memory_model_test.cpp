// The simulator's memory model against a measured step: the activation bytes each worker's thread
// holds at its peak (counting allocator, CPU) are within 10% of schedule::peak_bytes, the
// simulator's cells on that worker weighted by what one cell keeps, plus a backward's working
// memory. Schedules with split backwards (ZB-H1, ZB-V, V-Half, V-Min) are not asserted yet: there
// a stage's output, made and counted on its worker, lives until the next stage's W, which the
// per-worker model does not follow; measured errors of -11% to +19%, varying from run to run.
#include "benchmarks/common/memory.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;

namespace {

constexpr int kWidth = 128;
constexpr int kBlocks = 16;  // Linear + ReLU each
constexpr int kRows = 64;   // per micro-batch
constexpr int kChunks = 8;
constexpr int kWorkers = 4;

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); }

torch::nn::Sequential model(int blocks) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < blocks; ++i) {
    seq->push_back(torch::nn::Linear(kWidth, kWidth));
    seq->push_back(torch::nn::ReLU());
  }
  return seq;
}

// What one cell costs a worker, measured on a stage of `blocks` blocks alone (its parameters'
// gradients already there, as in a pipe after its first step): the bytes its forward keeps until
// its backward, and the most its backward allocates above them while it runs (the incoming and
// outgoing gradients, each weight gradient before it is added in).
struct CellCost {
  sched::CellBytes bytes;  // kept from F to I, from I to W, and a backward's working memory
};

CellCost cell_cost(int blocks, bool last) {
  auto& memory = sw::bench::counting_allocator();
  auto stage = model(blocks);
  auto x = torch::randn({kRows, kWidth});
  auto t = torch::randn({kRows, kWidth});
  auto g = torch::randn({kRows, kWidth});
  // The last stage's backward starts from the loss.
  auto backward = [&](const torch::Tensor& y) {
    if (last) {
      mse(y, t).backward();
    } else {
      y.backward(g);
    }
  };
  backward(stage->forward(x));  // the gradients exist
  CellCost c;
  const long long before = memory.current();
  {
    // Kept from F to the backward, and a whole backward's working memory.
    auto y = stage->forward(x);
    c.bytes.forward = static_cast<double>(memory.current() - before);
    memory.reset_peak();
    backward(y);
    c.bytes.working = static_cast<double>(memory.peak() - before) - c.bytes.forward;
  }
  {
    // Kept from I to W: the input gradient taken, the weight gradients not yet.
    auto leaf = x.detach().requires_grad_();
    auto y = stage->forward(leaf);
    sw::runtime::SplitBackward split;
    if (last) {
      auto loss = mse(y, t);
      split.input_grad({loss}, {torch::ones_like(loss)}, {leaf});
    } else {
      split.input_grad({y}, {g}, {leaf});
    }
    y = torch::Tensor();
    leaf = torch::Tensor();
    c.bytes.input_grad = static_cast<double>(memory.current() - before);
    split.weight_grad();
  }
  return c;
}

// Each worker's measured peak rise in one step after a warm-up, largest first, beside the
// simulator's cells per worker times the bytes of a cell, largest first.
template <class S>
void check_schedule(const std::string& name, S s, int stages, double tolerance) {
  CAPTURE(name);
  auto& memory = sw::bench::counting_allocator();
  auto seq = model(kBlocks);
  auto pipe = sw::Pipe(seq, sw::even_balance(seq->size(), stages),
                       sw::PipeOptions().chunks(kChunks).checkpoint("never"));
  auto x = torch::randn({kRows * kChunks, kWidth});
  auto t = torch::randn({kRows * kChunks, kWidth});
  pipe->train_step(x, t, mse, s);  // warm-up: gradients exist from here on
  const auto before = memory.thread_current();
  memory.reset_peak();
  pipe->train_step(x, t, mse, s);
  auto rises = memory.thread_rises(before);
  std::sort(rises.rbegin(), rises.rend());
  const auto plan = sched::plan(s, stages, kChunks);
  const auto cell = cell_cost(kBlocks / stages, false);
  const auto last = cell_cost(kBlocks / stages, true);
  // The simulator's cells on each worker, weighted by what a cell keeps before and after its I,
  // and the working memory of a backward while it runs (the last stage's starts from the loss).
  std::vector<sched::CellBytes> bytes(static_cast<std::size_t>(stages), cell.bytes);
  bytes.back() = last.bytes;
  std::vector<long long> predicted;
  for (double b : sched::peak_bytes(plan, bytes)) predicted.push_back(static_cast<long long>(b));
  std::sort(predicted.rbegin(), predicted.rend());
  REQUIRE(rises.size() >= predicted.size());
  for (std::size_t w = 0; w < predicted.size(); ++w) {
    CAPTURE(w);
    CAPTURE(rises[w]);
    CAPTURE(predicted[w]);
    CHECK(static_cast<double>(rises[w]) >= (1 - tolerance) * static_cast<double>(predicted[w]));
    CHECK(static_cast<double>(rises[w]) <= (1 + tolerance) * static_cast<double>(predicted[w]));
  }
  MESSAGE(name << ": cell " << cell.bytes.forward << " / " << cell.bytes.input_grad << " / "
               << cell.bytes.working << " bytes; last stage " << last.bytes.forward << " / "
               << last.bytes.input_grad << " / " << last.bytes.working);
  MESSAGE(name << ": measured peak rise per worker (largest first) " << rises[0] << " .. "
               << rises[predicted.size() - 1] << " bytes, predicted " << predicted[0] << " .. "
               << predicted.back());
}

}  // namespace

TEST_CASE("each worker's measured activation peak is within 10% of the simulator's") {
  sw::bench::counting_allocator();  // before the tensors to measure exist
  at::set_num_threads(1);
  check_schedule("gpipe", sched::gpipe{}, kWorkers, 0.10);
  check_schedule("one_f_one_b", sched::one_f_one_b{}, kWorkers, 0.10);
}
