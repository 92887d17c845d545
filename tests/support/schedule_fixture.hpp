#pragma once

// The fixture of the train-schedule tests: a small MLP, the unpipelined training step that a
// pipe's train_step must equal bit for bit, and the check that compares them under a schedule.

#include "stagewise/pipe.hpp"

#include <torch/torch.h>

#include "tests/support/grads.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <typeinfo>
#include <vector>

namespace stagewise::testing {

inline torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

/// Eight layers, 6 -> 3 features; `dropout` after the first ReLU.
inline torch::nn::Sequential mlp(double dropout = 0.0) {
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::ReLU(),
                               torch::nn::Dropout(dropout), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::ReLU(),
                               torch::nn::Linear(8, 3));
}

/// Unpipelined training on the same micro-batches: every forward, then the backwards in the
/// order each stage of the pipe runs them (GPipe and looped BFS: M-1 .. 0; the others 0 .. M-1),
/// so each parameter's gradient sums the same terms in the same order and the result is bit for
/// bit equal. Returns the summed loss, each micro-batch's weighted by its share of the rows.
inline torch::Tensor reference_step(
    torch::nn::SequentialImpl& seq, const torch::Tensor& x, const torch::Tensor& t, int64_t chunks,
    bool ascending = false,
    const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss = mse) {
  auto xs = x.chunk(chunks);
  auto ts = t.chunk(chunks);
  std::vector<torch::Tensor> losses;
  torch::Tensor total;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double w = static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0));
    losses.push_back(loss(seq.forward(xs[i]), ts[i]) * w);
    total = total.defined() ? total + losses.back().detach() : losses.back().detach();
  }
  if (ascending) {
    for (auto& l : losses) l.backward();
  } else {
    for (auto it = losses.rbegin(); it != losses.rend(); ++it) it->backward();
  }
  return total;
}

/// Copies of a module's parameters' gradients.
inline std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  return grads_of(m.parameters());
}

/// Trains `mlp(dropout)` one step with `s` over balance `b` (10 rows in 4 chunks: 3, 3, 3, 1) in
/// each of `modes` and checks the loss and every gradient equal to reference_step's, bit for bit.
template <class Schedule>
void check_equal_to_reference(const Schedule& s, const balance& b, bool ascending,
                              double dropout = 0.0,
                              std::vector<Checkpoint> modes = {
                                  Checkpoint::never, Checkpoint::except_last, Checkpoint::always}) {
  for (auto mode : modes) {
    const std::string mode_name = to_string(mode);
    const std::string schedule_name = typeid(Schedule).name();  // mangled, enough to tell apart
    CAPTURE(mode_name);
    CAPTURE(schedule_name);
    torch::manual_seed(3);
    auto seq = mlp(dropout);
    auto x = torch::randn({10, 6});
    auto t = torch::randn({10, 3});
    torch::manual_seed(5);
    auto expected_loss = reference_step(*seq, x, t, 4, ascending);
    auto expected = grads_of(*seq);
    seq->zero_grad();
    auto pipe = Pipe(seq, b, PipeOptions().chunks(4).checkpoint(mode));
    torch::manual_seed(5);
    torch::Tensor loss = pipe->train_step(x, t, mse, s);
    CHECK(loss.item<float>() == expected_loss.item<float>());
    auto got = grads_of(*seq);
    REQUIRE(got.size() == expected.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      CAPTURE(k);
      REQUIRE(got[k].defined());
      CHECK(got[k].equal(expected[k]));
    }
  }
}

}  // namespace stagewise::testing
