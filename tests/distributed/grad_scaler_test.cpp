// amp::GradScaler over many ranks: an inf that one rank's gradients hold at chosen steps skips
// the step on every rank, and every rank's scale follows PyTorch's rules, step for step: on a
// distributed pipe (300 steps, the unfused optimizer; and the fused step, clipped or not), on 2
// stages x 2 replicas, and under DataParallel. The pipe's ranks end with the one-process pipe's
// parameters, bit for bit.

#include "stagewise/distributed.hpp"
#include "stagewise/optim/grad_scaler.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace scaler_ranks {

// Set by a rank before a step it injects into: the gradient through an Inject layer becomes
// inf (process-wide: a forked rank has its own).
std::atomic<bool>& inject() {
  static std::atomic<bool> on{false};
  return on;
}

struct InfGrad : torch::autograd::Function<InfGrad> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    if (inject()) return {g[0] * std::numeric_limits<float>::infinity()};
    return {g[0]};
  }
};

struct InjectImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return InfGrad::apply(x); }
};
TORCH_MODULE(Inject);

// Stage 0: Linear, Inject, Tanh; stage 1: Linear, Tanh, Linear (balance {3, 3}).
torch::nn::Sequential model() {
  torch::manual_seed(13);
  return torch::nn::Sequential(torch::nn::Linear(4, 6), Inject(), torch::nn::Tanh(),
                               torch::nn::Linear(6, 6), torch::nn::Tanh(), torch::nn::Linear(6, 2));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(900 + step);
  return {torch::randn({8, 4}), torch::randn({8, 2})};
}

// PyTorch's rules (torch.amp.GradScaler's documentation), written out on their own: the outcome
// of every step ("1" stepped, "0" skipped) and the scale after its update, as one text.
std::string expected(int steps, const std::set<int>& bad, double scale, int interval) {
  std::string out;
  int clean = 0;
  for (int s = 0; s < steps; ++s) {
    if (bad.count(s)) {
      scale *= 0.5;
      clean = 0;
    } else if (++clean == interval) {
      scale *= 2.0;
      clean = 0;
    }
    char buf[48];
    std::snprintf(buf, sizeof buf, "%d:%a ", bad.count(s) ? 0 : 1, scale);
    out += buf;
  }
  return out;
}

std::string outcome(bool stepped, const sw::amp::GradScaler& scaler) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%d:%a ", stepped ? 1 : 0, scaler.get_scale());
  return buf;
}

sw::distributed::Options options(const std::string& name, int replicas = 1) {
  return sw::distributed::Options().data_parallel(replicas).transport(
      sw::runtime::C10dOptions().prefix(name).timeout(20s));
}

// This rank's parameters equal the one-process pipe's (same names), bit for bit.
void check_like(torch::nn::Module& mine, torch::nn::Module& one_process) {
  const auto theirs = one_process.named_parameters();
  for (const auto& p : mine.named_parameters()) {
    TORCH_CHECK(torch::equal(p.value(), theirs[p.key()]), p.key(),
                " differs from the one-process pipe's");
  }
}

// `steps` steps with the unfused SGD and a scaler on 2 ranks (rank 0 injects at `bad`), and on
// the one-process pipe beside it; returns this rank's outcomes.
std::string unfused(const sw::runtime::Connection& c, int steps, const std::set<int>& bad) {
  auto seq = model(), ref_seq = model();
  sw::distributed::Pipe pipe(c, seq, sw::balance{3, 3}, sw::PipeOptions().chunks(2),
                             options("unfused"));
  auto ref = sw::Pipe(ref_seq, sw::balance{3, 3}, sw::PipeOptions().chunks(2));
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD opt(pipe->parameters(), sgd), ref_opt(ref->parameters(), sgd);
  const auto growth = sw::amp::GradScalerOptions().growth_interval(10);
  sw::amp::GradScaler scaler(growth), ref_scaler(growth);
  std::string out;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s);
    inject() = bad.count(s) > 0;  // only stage 0 (rank 0) has the layer that injects
    opt.zero_grad();
    pipe->train_step(pipe->has_stage(0) ? x : torch::Tensor(), pipe->has_stage(1) ? y : torch::Tensor(),
                     mse, scaler, sched::one_f_one_b{});
    const bool stepped = scaler.step(opt);
    scaler.update();
    out += outcome(stepped, scaler);
    ref_opt.zero_grad();
    ref->train_step(x, y, mse, ref_scaler, sched::one_f_one_b{});
    TORCH_CHECK(ref_scaler.step(ref_opt) == stepped, "step ", s, ": the one-process pipe differs");
    ref_scaler.update();
  }
  check_like(*pipe, *ref);
  return out;
}

// The fused AdamW under a scaler on 2 ranks, clipped (pipe->clip_grad_norm_step) or not, with
// `s`; the one-process pipe beside it.
template <class Schedule>
std::string fused(const sw::runtime::Connection& c, const std::string& name, const Schedule& s,
                  bool clip, const std::set<int>& bad) {
  auto seq = model(), ref_seq = model();
  sw::distributed::Pipe pipe(c, seq, sw::balance{3, 3}, sw::PipeOptions().chunks(2),
                             options(name));
  auto ref = sw::Pipe(ref_seq, sw::balance{3, 3}, sw::PipeOptions().chunks(2));
  const auto adamw = torch::optim::AdamWOptions(1e-2);
  sw::optim::FusedStep f(pipe->parameters(), adamw), ref_f(ref->parameters(), adamw);
  const auto growth = sw::amp::GradScalerOptions().init_scale(64).growth_interval(2);
  sw::amp::GradScaler scaler(growth), ref_scaler(growth);
  std::string out;
  for (int step = 0; step < 6; ++step) {
    auto [x, y] = batch(step);
    inject() = bad.count(step) > 0;
    const auto in = pipe->has_stage(0) ? x : torch::Tensor();
    const auto target = pipe->has_stage(1) ? y : torch::Tensor();
    const auto before = pipe->parameters().front().detach().clone();
    if (clip) {
      pipe->clip_grad_norm_step(f, [&] { pipe->train_step(in, target, mse, f, scaler, s); }, 0.1,
                                scaler);
      ref->clip_grad_norm_step(ref_f, [&] { ref->train_step(x, y, mse, ref_f, ref_scaler, s); },
                               0.1, ref_scaler);
    } else {
      pipe->train_step(in, target, mse, f, scaler, s);
      ref->train_step(x, y, mse, ref_f, ref_scaler, s);
    }
    scaler.update();
    ref_scaler.update();
    out += outcome(!torch::equal(before, pipe->parameters().front()), scaler);
    TORCH_CHECK(scaler.get_scale() == ref_scaler.get_scale(), name, " step ", step,
                ": the scale differs from the one-process pipe's");
  }
  check_like(*pipe, *ref);
  return out;
}

// FNV-1a over the bytes of this rank's parameters.
std::string digest(torch::nn::Module& m) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& p : m.parameters()) {
    const auto c = p.detach().contiguous();
    const auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (std::size_t i = 0; i < c.nbytes(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

// Steps [from, to) of Adam and a scaler on 2 ranks (rank 0 injects at `bad`), resumed from
// `load` if given, saved after step `save_at` into `dir` if given; reports the scales from
// step `from` on and this rank's parameters' digest.
void resumable(int from, int to, const std::set<int>& bad, const std::string& dir, int save_at,
               bool load) {
  auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
  sw::distributed::Pipe pipe(c, model(), sw::balance{3, 3}, sw::PipeOptions().chunks(2),
                             options("resume"));
  torch::optim::Adam opt(pipe->parameters(), torch::optim::AdamOptions(1e-2));
  sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().init_scale(1024).growth_interval(2));
  if (load) TORCH_CHECK(pipe->load(dir, opt, scaler) == from - 1, "loaded another step");
  std::string out;
  for (int s = from; s < to; ++s) {
    auto [x, y] = batch(s);
    inject() = bad.count(s) > 0;
    opt.zero_grad();
    pipe->train_step(pipe->has_stage(0) ? x : torch::Tensor(),
                     pipe->has_stage(1) ? y : torch::Tensor(), mse, scaler, sched::one_f_one_b{});
    const bool stepped = scaler.step(opt);
    scaler.update();
    out += outcome(stepped, scaler);
    if (s == save_at) pipe->save(dir, opt, scaler, s);
  }
  report(out + digest(*pipe));
}

void expect_all(const std::vector<sw::testing::RankOutcome>& r, const std::string& want) {
  for (std::size_t k = 0; k < r.size(); ++k) {
    CAPTURE(k);
    CHECK(r[k].status == 0);
    CHECK(r[k].text == want);
  }
}

}  // namespace scaler_ranks

TEST_SUITE("amp::GradScaler over many ranks") {
  TEST_CASE("distributed pipe, 300 steps: rank 0's infs skip every rank; scales follow the rules") {
    const std::set<int> bad = {0, 1, 2, 25, 60, 61, 140, 141, 142, 220, 299};
    auto r = run_ranks(
        2,
        [&](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          report(scaler_ranks::unfused(c, 300, bad));
        },
        180s);
    scaler_ranks::expect_all(r, scaler_ranks::expected(300, bad, 65536.0, 10));
  }

  TEST_CASE("distributed pipe, fused AdamW under the scaler: unclipped (1F1B), clipped (ZB-H1)") {
    const std::set<int> bad = {1, 4};
    auto r = run_ranks(
        2,
        [&](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          report(scaler_ranks::fused(c, "f1", sched::one_f_one_b{}, false, bad) + "| " +
                 scaler_ranks::fused(c, "fz", sched::zero_bubble_h1{}, true, bad));
        },
        120s);
    const auto want = scaler_ranks::expected(6, bad, 64.0, 2);
    scaler_ranks::expect_all(r, want + "| " + want);
  }

  TEST_CASE("2 stages x 2 replicas: an inf on one replica's stage 0 skips all four ranks") {
    const std::set<int> bad = {3, 4, 9};
    auto r = run_ranks(
        4,
        [&](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          sw::distributed::Pipe pipe(c, scaler_ranks::model(), sw::balance{3, 3},
                                     sw::PipeOptions().chunks(2), scaler_ranks::options("dp", 2));
          torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.05));
          sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().growth_interval(3));
          std::string out;
          for (int s = 0; s < 12; ++s) {
            auto [x, y] = scaler_ranks::batch(s);
            scaler_ranks::inject() = rank == 2 && bad.count(s) > 0;  // replica 1, stage 0
            opt.zero_grad();
            pipe->train_step(pipe->has_stage(0) ? pipe->shard(x) : torch::Tensor(),
                             pipe->has_stage(1) ? pipe->shard(y) : torch::Tensor(),
                             scaler_ranks::mse, scaler, sched::one_f_one_b{});
            const bool stepped = scaler.step(opt);
            scaler.update();
            out += scaler_ranks::outcome(stepped, scaler);
          }
          report(out);
        },
        120s);
    scaler_ranks::expect_all(r, scaler_ranks::expected(12, bad, 65536.0, 3));
  }

  TEST_CASE("a save with the scaler, loaded by a new job, continues bit for bit") {
    const std::set<int> bad = {1, 5};
    const char* tmp = std::getenv("TEST_TMPDIR");
    const std::string dir = std::string(tmp ? tmp : "/tmp") + "/grad_scaler_resume_" +
                            std::to_string(::getpid());
    auto whole = run_ranks(2, [&](int) { scaler_ranks::resumable(0, 8, bad, "", -1, false); }, 60s);
    auto first = run_ranks(2, [&](int) { scaler_ranks::resumable(0, 4, bad, dir, 3, false); }, 60s);
    auto resumed = run_ranks(2, [&](int) { scaler_ranks::resumable(4, 8, bad, dir, -1, true); }, 60s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      REQUIRE(whole[k].status == 0);
      CHECK(first[k].status == 0);
      REQUIRE(resumed[k].status == 0);
      // The outcomes of steps 4..7 and the parameters' digest: the whole run's tail.
      const auto& w = whole[k].text;
      const auto& r = resumed[k].text;
      const auto tail = w.substr(w.size() - r.size());
      CHECK(tail == r);
      CHECK(w.rfind(scaler_ranks::expected(8, bad, 1024.0, 2), 0) == 0);
    }
  }

  TEST_CASE("DataParallel: rank 1's inf reaches every rank through the averaged gradients") {
    const std::set<int> bad = {2, 5};
    auto r = run_ranks(
        2,
        [&](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          sw::distributed::DataParallel dp(c, scaler_ranks::model());
          torch::optim::SGD opt(dp.module()->parameters(), torch::optim::SGDOptions(0.05));
          sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().growth_interval(3));
          std::string out;
          for (int s = 0; s < 8; ++s) {
            auto [x, y] = scaler_ranks::batch(s);
            scaler_ranks::inject() = rank == 1 && bad.count(s) > 0;
            opt.zero_grad();
            scaler.scale(scaler_ranks::mse(dp.forward(dp.shard(x)), dp.shard(y))).backward();
            const bool stepped = scaler.step(opt);
            scaler.update();
            out += scaler_ranks::outcome(stepped, scaler);
          }
          report(out);
        },
        60s);
    scaler_ranks::expect_all(r, scaler_ranks::expected(8, bad, 65536.0, 3));
  }
}
