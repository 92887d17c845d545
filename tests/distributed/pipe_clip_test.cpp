// Clipping by the whole model's gradient norm on a distributed pipe (issue #35):
// pipe->clip_grad_norm_step with the fused AdamW on 2 ranks (and on 2 stages x 2 replicas) gives
// every rank the same total norm, bit for bit, equal to the one-process pipe's and, within float
// rounding, to clip_grad_norm_ and AdamW on the unpipelined model; the rank-local
// optim::clip_grad_norm_step is refused there, naming the fix.

#include "stagewise/distributed.hpp"
#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace clip {

constexpr double kMaxNorm = 0.05;  // the norms here are about 0.3 to 1: every step clips
constexpr int kRows = 12;          // 3 micro-batches of 4 (of 2 per replica with 2 replicas)

// Eight layers: balance {4, 4} (2 stages) or {2, 2, 2, 2} (interleaved, 2 stages per rank).
torch::nn::Sequential model(std::uint64_t seed = 7) {
  torch::manual_seed(seed);
  torch::nn::Sequential s;
  s->push_back(torch::nn::Linear(6, 8));
  s->push_back(torch::nn::Tanh());
  s->push_back(torch::nn::Linear(8, 8));
  s->push_back(torch::nn::Tanh());
  s->push_back(torch::nn::Linear(8, 8));
  s->push_back(torch::nn::Tanh());
  s->push_back(torch::nn::Identity());
  s->push_back(torch::nn::Linear(8, 3));
  return s;
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(300 + step);
  return {torch::randn({kRows, 6}) * 3, torch::randn({kRows, 3})};
}

const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);

std::string hex(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", v);
  return buf;
}

// The largest relative difference seen against the unpipelined model (printed by each rank).
double& largest() {
  static double d = 0;
  return d;
}

double relative(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-6);
  return (a - b).abs().max().item<double>() / scale;
}

// Trains 3 clipped steps on the distributed pipe (2 stages per replica, `replicas` replicas), on
// the one-replica pipe in this process (`pipe->clip_grad_norm_step`, the same code) over the
// whole batch, and on the unpipelined model with clip_grad_norm_ and AdamW. Checks, throwing
// what differs: the total norms and this rank's parameters equal the one-process pipe's bit for
// bit with one replica (with two, within 1e-6 relative: averaging the replicas' gradients rounds
// otherwise than the whole batch's gradient), and equal the unpipelined model's within 1e-6
// relative (the micro-batches' gradients add up in another order). Returns this rank's total
// norms, exactly, for the parent to compare across ranks.
template <class Schedule>
std::string compare(const sw::runtime::Connection& c, const std::string& name, const Schedule& s,
                    int virtual_stages, int replicas) {
  const auto b = virtual_stages == 2 ? sw::balance{2, 2, 2, 2} : sw::balance{4, 4};
  auto seq = model(), ref_seq = model(), plain = model();
  const auto options = sw::PipeOptions().chunks(3);
  sw::distributed::Pipe pipe(c, seq, b, options,
                             sw::distributed::Options()
                                 .virtual_stages(virtual_stages)
                                 .data_parallel(replicas)
                                 .transport(sw::runtime::C10dOptions().prefix(name).timeout(20s)));
  auto ref = sw::Pipe(ref_seq, b, options);
  sw::optim::FusedStep fused(pipe->named_parameters(), adamw);
  sw::optim::FusedStep ref_fused(ref->named_parameters(), adamw);
  torch::optim::AdamW plain_opt(plain->parameters(), adamw);
  const double exact = replicas == 1 ? 0.0 : 1e-6;
  std::string norms;
  for (int step = 0; step < 3; ++step) {
    const auto what = name + ", step " + std::to_string(step);
    auto [x, y] = batch(step);
    const bool first = pipe->has_stage(0), last = pipe->has_stage(pipe->num_stages() - 1);
    const auto in = first ? pipe->shard(x) : torch::Tensor();
    const auto target = last ? pipe->shard(y) : torch::Tensor();
    const auto r = pipe->clip_grad_norm_step(
        fused, [&] { pipe->train_step(in, target, mse, fused, s); }, kMaxNorm);
    const auto ref_r = ref->clip_grad_norm_step(
        ref_fused, [&] { ref->train_step(x, y, mse, ref_fused, s); }, kMaxNorm);
    mse(plain->forward(x), y).backward();
    const double plain_norm = torch::nn::utils::clip_grad_norm_(plain->parameters(), kMaxNorm);
    plain_opt.step();
    plain_opt.zero_grad();
    TORCH_CHECK(r.total_norm > kMaxNorm, what, ": no clipping (norm ", r.total_norm, ")");
    const double to_ref = std::abs(r.total_norm - ref_r.total_norm) / ref_r.total_norm;
    TORCH_CHECK(to_ref <= exact, what, ": total norm ", hex(r.total_norm),
                " but the one-process pipe's is ", hex(ref_r.total_norm));
    largest() = std::max(largest(), std::abs(r.total_norm - plain_norm) / plain_norm);
    TORCH_CHECK(std::abs(r.total_norm - plain_norm) <= 1e-6 * plain_norm, what, ": total norm ",
                r.total_norm, " but clip_grad_norm_'s on the unpipelined model is ", plain_norm);
    norms += hex(r.total_norm) + " ";
  }
  int layer = 0;
  for (std::size_t j = 0; j < b.size(); ++j) {
    for (int k = 0; k < b[j]; ++k, ++layer) {
      if (!pipe->has_stage(static_cast<int>(j))) continue;
      const auto l = static_cast<std::size_t>(layer);
      auto mine = seq[l]->parameters();
      auto theirs = ref_seq[l]->parameters();
      auto whole = plain[l]->parameters();
      for (std::size_t p = 0; p < mine.size(); ++p) {
        const auto what = name + ": layer " + std::to_string(layer) + " after three steps";
        const double d = relative(mine[p], theirs[p]);
        TORCH_CHECK(d <= exact, what, " differs from the one-process pipe's by ", d);
        const double e = relative(mine[p], whole[p]);
        largest() = std::max(largest(), e);
        TORCH_CHECK(e <= 1e-6, what, " differs from the unpipelined model's by ", e);
      }
    }
    for (const auto& p : pipe->parameters()) {
      TORCH_CHECK(!p.grad().defined(), name, ": a gradient was left after the step");
    }
  }
  std::printf("rank %d, %s: largest relative difference to the unpipelined model %.3g\n",
              c.env.rank, name.c_str(), largest());
  std::fflush(stdout);
  return norms;
}

// Every rank's report is the same, non-empty, and has no error.
void expect_same(const std::vector<sw::testing::RankOutcome>& r) {
  for (std::size_t k = 0; k < r.size(); ++k) {
    CAPTURE(k);
    CAPTURE(r[k].text);
    CHECK(r[k].status == 0);
    CHECK(r[k].text.find("norms:") == 0);
    CHECK(r[k].text == r[0].text);
  }
}

}  // namespace clip

TEST_SUITE("clipping by the whole model's norm on a distributed pipe") {
  TEST_CASE("2 ranks: the one-process pipe's norm and step, bit for bit; the unpipelined model's") {
    auto r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          std::string out = "norms: ";
          out += clip::compare(c, "1f1b", sched::one_f_one_b{}, 1, 1);
          out += clip::compare(c, "zb", sched::zero_bubble_h1{}, 1, 1);
          // Rank 0 runs stages 0 and 2, rank 1 stages 1 and 3: the norms still total in stage
          // order.
          out += clip::compare(c, "il", sched::interleaved_one_f_one_b{2}, 2, 1);
          report(out);
        },
        120s);
    clip::expect_same(r);
  }

  TEST_CASE("2 stages x 2 replicas: the averaged gradients' norm, counted once") {
    auto r = run_ranks(
        4,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          report("norms: " + clip::compare(c, "dp", sched::one_f_one_b{}, 1, 2));
        },
        120s);
    clip::expect_same(r);
  }

  TEST_CASE("the rank-local optim::clip_grad_norm_step is refused on every rank, naming the fix") {
    auto r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          sw::distributed::Pipe pipe(c, clip::model(), sw::balance{4, 4},
                                     sw::PipeOptions().chunks(2),
                                     sw::distributed::Options().transport(
                                         sw::runtime::C10dOptions().prefix("refuse").timeout(20s)));
          sw::optim::FusedStep fused(pipe->parameters(), clip::adamw);
          const auto before = pipe->parameters()[0].detach().clone();
          auto [x, y] = clip::batch(0);
          const auto in = pipe->has_stage(0) ? x : torch::Tensor();
          const auto target = pipe->has_stage(1) ? y : torch::Tensor();
          report(error_of([&] {
            sw::optim::clip_grad_norm_step(
                fused, [&] { pipe->train_step(in, target, clip::mse, fused); }, 1.0);
          }));
          TORCH_CHECK(torch::equal(before, pipe->parameters()[0]), "a parameter changed");
          // The pipe and the fused step still work, clipping through the pipe.
          pipe->clip_grad_norm_step(
              fused, [&] { pipe->train_step(in, target, clip::mse, fused); }, 1.0);
          TORCH_CHECK(!torch::equal(before, pipe->parameters()[0]), "nothing stepped");
        },
        60s);
    for (std::size_t k = 0; k < r.size(); ++k) {
      CAPTURE(k);
      CHECK(r[k].status == 0);
      CHECK(r[k].text ==
            "stagewise::distributed::Pipe::train_step: optim::clip_grad_norm_step around a pipe "
            "whose stages run on 2 processes would clip each by its own stages' gradient norm; "
            "call pipe->clip_grad_norm_step(fused, closure, max_norm) instead (the same "
            "arguments), which clips every rank by the whole model's norm");
    }
  }
}
