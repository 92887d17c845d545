#pragma once

// The shared transport tests: what every `runtime::pipe_transport` must do under the pipe
// (`stagewise::PipeOver`). Each check runs on one process (rank) of a job and throws, naming
// what differs; the caller runs it on every rank at once (threads or processes) and expects no
// error anywhere. `make(seq, balance, options)` builds the rank's pipe over the transport under
// test (a new pipe per call; every rank makes the same calls). The model has two stages; a job
// has one process (every stage in it) or two (stage j on rank j).
//   run_on_every_rank([&](int rank) { transport_suite::run_all(rank, make_for(rank), dir); });

#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace stagewise::testing::transport_suite {

// The same model and batches on every rank, with no random generator (ranks may be threads of
// one process, which would share it).
inline torch::Tensor pattern(std::int64_t rows, std::int64_t cols, double phase) {
  return torch::sin(torch::arange(rows * cols, torch::kFloat32) * 0.37 + phase)
      .reshape({rows, cols});
}
inline torch::nn::Sequential model() {
  torch::nn::Sequential seq(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                            torch::nn::ReLU(), torch::nn::Linear(8, 3));
  torch::NoGradGuard no_grad;
  double phase = 0;
  for (auto& p : seq->parameters()) {
    p.copy_(pattern(1, p.numel(), phase += 1).reshape(p.sizes()) * 0.5);
  }
  return seq;
}
inline stagewise::balance two_stages() {
  return stagewise::balance{3, 2};
}

inline torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

// The step's input where this process runs stage 0, its target where it runs the last stage.
template <class P>
std::pair<torch::Tensor, torch::Tensor> batch_for(const P& pipe, int step) {
  const auto x = pattern(8, 6, 10.0 + step);
  const auto y = pattern(8, 3, 20.0 + step);
  const auto here = pipe->processes();
  return {here.runs(0) ? x : torch::Tensor(), here.runs(1) ? y : torch::Tensor()};
}

/// Two steps (1F1B with checkpointing, then ZB-H1) equal the one-process pipe bit for bit: the
/// loss on every rank, and this rank's stages' gradients. Messages cross ranks exactly as the
/// plan says: 4 activations one way and 4 gradients back per step (none in one process).
template <class Make>
void equals_one_process(Make make) {
  const auto options = PipeOptions().chunks(4).checkpoint(Checkpoint::always);
  auto ref = Pipe(model(), two_stages(), options);
  auto pipe = make(model(), two_stages(), options);
  const auto here = pipe->processes();
  for (int step = 0; step < 2; ++step) {
    const auto x = pattern(8, 6, 10.0 + step);
    const auto y = pattern(8, 3, 20.0 + step);
    const auto [in, target] = batch_for(pipe, step);
    torch::Tensor want, got;
    if (step == 0) {
      want = ref->train_step(x, y, mse, schedule::one_f_one_b{});
      got = pipe->train_step(in, target, mse, schedule::one_f_one_b{});
    } else {
      want = ref->train_step(x, y, mse, schedule::zero_bubble_h1{});
      got = pipe->train_step(in, target, mse, schedule::zero_bubble_h1{});
    }
    TORCH_CHECK(torch::equal(got, want), "rank ", here.rank, " step ", step, ": loss ",
                got.item<double>(), " but the one-process pipe's is ", want.item<double>());
  }
  const auto mine = pipe->named_parameters();
  const auto theirs = ref->named_parameters();
  std::int64_t kept = 0;
  for (const auto& p : theirs) {
    const int stage = p.key().rfind("stage1.", 0) == 0 ? 1 : 0;
    if (!here.runs(static_cast<std::size_t>(stage))) {
      TORCH_CHECK(mine.find(p.key()) == nullptr, "rank ", here.rank, " keeps ", p.key(),
                  " of a stage another process runs");
      continue;
    }
    ++kept;
    const auto* q = mine.find(p.key());
    TORCH_CHECK(q != nullptr, "rank ", here.rank, " lacks ", p.key());
    TORCH_CHECK(torch::equal(q->grad(), p.value().grad()), "rank ", here.rank, ": ", p.key(),
                "'s gradient differs from the one-process pipe's");
  }
  TORCH_CHECK(kept == static_cast<std::int64_t>(mine.size()), "rank ", here.rank, " has ",
              mine.size(), " parameters, its stages ", kept);
  const std::int64_t crossing = here.count == 1 ? 0 : 8;
  const auto t = pipe->traffic();
  TORCH_CHECK(t.messages_sent == crossing && t.messages_received == crossing, "rank ", here.rank,
              " sent ", t.messages_sent, " and received ", t.messages_received,
              " messages; the plan sends ", crossing, " each way");
}

/// A loss that throws on the last stage's process fails the step on every rank with its text.
template <class Make>
void failure_reaches_every_rank(Make make) {
  auto pipe = make(model(), two_stages(), PipeOptions().chunks(2));
  const auto [in, target] = batch_for(pipe, 0);
  auto bad_loss = [](const torch::Tensor& out, const torch::Tensor&) -> torch::Tensor {
    (void)out;
    throw std::runtime_error("the loss refuses");
  };
  const auto error = error_of([&] { pipe->train_step(in, target, bad_loss); });
  TORCH_CHECK(contains(error, "the loss refuses"), "rank ", pipe->processes().rank,
              " failed with \"", error, "\", not with the loss's error");
}

/// A save and a load through the transport's `gather`: every rank writes its stages' files, and
/// loading the save gives back the step and the parameters it held.
template <class Make>
void save_and_load(Make make, const std::string& dir) {
  auto pipe = make(model(), two_stages(), PipeOptions().chunks(2));
  const auto [in, target] = batch_for(pipe, 0);
  pipe->train_step(in, target, mse);
  std::vector<torch::Tensor> saved;
  for (const auto& p : pipe->parameters()) saved.push_back(p.detach().clone());
  pipe->save(dir, 7);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : pipe->parameters()) p.zero_();
  }
  const auto step = pipe->load(dir);
  TORCH_CHECK(step == 7, "rank ", pipe->processes().rank, " loaded step ", step, ", saved 7");
  const auto params = pipe->parameters();
  for (std::size_t k = 0; k < params.size(); ++k) {
    TORCH_CHECK(torch::equal(params[k], saved[k]), "rank ", pipe->processes().rank, ": parameter ",
                k, " differs after the load");
  }
}

/// Two clipped steps (`pipe->clip_grad_norm_step` around the fused train_step: every rank's
/// gradient norms cross through `runtime::gather_values`, the transport's own or, without it, its
/// text `gather`) total the one-process pipe's norm bit for bit, on every rank, and leave this
/// rank's parameters as the one-process pipe leaves them.
template <class Make>
void clip_equals_one_process(Make make) {
  const auto options = PipeOptions().chunks(4);
  auto ref = Pipe(model(), two_stages(), options);
  auto pipe = make(model(), two_stages(), options);
  const auto sgd = torch::optim::SGDOptions(0.1);
  optim::FusedStep fused(pipe->named_parameters(), sgd), ref_fused(ref->named_parameters(), sgd);
  const int rank = pipe->processes().rank;
  for (int step = 0; step < 2; ++step) {
    const auto x = pattern(8, 6, 10.0 + step);
    const auto y = pattern(8, 3, 20.0 + step);
    const auto [in, target] = batch_for(pipe, step);
    const auto got = pipe->clip_grad_norm_step(
        fused, [&] { pipe->train_step(in, target, mse, fused); }, 0.05);
    const auto want = ref->clip_grad_norm_step(
        ref_fused, [&] { ref->train_step(x, y, mse, ref_fused); }, 0.05);
    TORCH_CHECK(want.total_norm > 0.05, "step ", step, " does not clip (norm ", want.total_norm,
                ")");
    TORCH_CHECK(got.total_norm == want.total_norm, "rank ", rank, " step ", step,
                ": total norm ", got.total_norm, " but the one-process pipe's is ",
                want.total_norm);
  }
  const auto theirs = ref->named_parameters();
  for (const auto& p : pipe->named_parameters()) {
    TORCH_CHECK(torch::equal(p.value(), theirs[p.key()]), "rank ", rank, ": ", p.key(),
                " differs from the one-process pipe's after two clipped steps");
  }
}

/// Every check, in order, the failure last (a transport between processes may not outlive a
/// failure: make() may then need a fresh connection). Every rank runs the same.
template <class Make>
void run_all(Make make, const std::string& dir) {
  equals_one_process(make);
  clip_equals_one_process(make);
  save_and_load(make, dir);
  failure_reaches_every_rank(make);
}

}  // namespace stagewise::testing::transport_suite
