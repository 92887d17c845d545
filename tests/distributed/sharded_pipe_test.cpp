// The 2-D pipe (2 stages x 2 replicas on 4 ranks) with each stage's optimizer state sharded over
// its replicas: under GPipe, 1F1B, ZB-H1 and interleaved 1F1B, SGD with momentum and Adam,
// unfused (distributed::Sharded) and fused, clipped by the whole model's norm, under a GradScaler
// whose step an inf in one replica skips, and every way of reduce-scattering: parameters and
// losses equal to the unsharded 2-D pipe bit for bit (2 replicas: a + b == b + a) and to the
// one-process pipe on the whole batch; each rank keeps state for its own parameters only; saves
// resume bit for bit, also after a rank is killed mid-step; ranks that shard differently are
// named.

#include "stagewise/distributed.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"
#include "tests/support/pipe_layers.hpp"

#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace zpipe {

constexpr int kRanks = 4;  // 2 stages x 2 replicas
constexpr int kRows = 12;  // 6 per replica: 3 micro-batches of 2 rows

// Identity forward; in backward, gives its parameter an infinite gradient when armed (a
// GradScaler's inf in one parameter of one replica, the others finite).
struct InfGrad : torch::autograd::Function<InfGrad> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& p, bool armed) {
    ctx->saved_data["armed"] = armed;
    ctx->saved_data["shape"] = p.sizes().vec();
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const bool armed = ctx->saved_data["armed"].toBool();
    auto shape = ctx->saved_data["shape"].toIntVector();
    auto g = torch::full(shape, armed ? std::numeric_limits<float>::infinity() : 0.0F);
    return {grads[0], g, torch::Tensor()};
  }
};
int& armed_calls() {  // forwards left to arm, in this process
  static int n = 0;
  return n;
}
struct PoisonImpl : torch::nn::Module {
  PoisonImpl() : p(register_parameter("p", torch::zeros({1}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const bool armed = armed_calls() > 0;
    if (armed) --armed_calls();
    return InfGrad::apply(x, p, armed);
  }
  torch::Tensor p;
};
TORCH_MODULE(Poison);

// Eight layers (balance {4, 4}, or {2, 2, 2, 2} interleaved), a Poison in the second stage.
torch::nn::Sequential model(std::uint64_t seed = 7) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh(),
                               Poison(), torch::nn::Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  return {torch::randn({kRows, 6}), torch::randn({kRows, 3})};
}

struct Config {
  std::string name;
  int virtual_stages = 1;
  sw::Checkpoint mode = sw::Checkpoint::except_last;
  std::string kind = "sgd";  // or "adam"
  bool fused = false;
  double clip = 0;      // > 0: clipped by the whole model's norm
  bool scaler = false;  // step 1: an inf in Poison's gradient on replica 1
  sw::runtime::ReduceScatter how = sw::runtime::ReduceScatter::reduce;
  bool each_pass = false;  // shard_gradients: every micro-batch reduce-scattered as it goes
  bool twice = false;      // unfused: two train_steps on the step's two halves, then one step
};

std::unique_ptr<torch::optim::Optimizer> unsharded_opt(const std::string& kind,
                                                       std::vector<torch::Tensor> params) {
  if (kind == "adam") {
    return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(1e-2));
  }
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(0.1).momentum(0.9));
}

std::unique_ptr<torch::optim::Optimizer> sharded(const std::string& kind,
                                                 sw::distributed::Pipe& pipe) {
  if (kind == "adam") {
    return std::make_unique<sw::distributed::Sharded<torch::optim::Adam>>(
        pipe, torch::optim::AdamOptions(1e-2));
  }
  return std::make_unique<sw::distributed::Sharded<torch::optim::SGD>>(
      pipe, torch::optim::SGDOptions(0.1).momentum(0.9));
}

std::unique_ptr<sw::optim::FusedStep> fused_of(const std::string& kind,
                                               sw::distributed::Pipe& pipe) {
  if (kind == "adam") {
    return std::make_unique<sw::optim::FusedStep>(pipe->named_parameters(),
                                                  torch::optim::AdamOptions(1e-2));
  }
  return std::make_unique<sw::optim::FusedStep>(pipe->named_parameters(),
                                                torch::optim::SGDOptions(0.1).momentum(0.9));
}

double clip_of(torch::optim::Optimizer& opt, double max_norm) {
  if (auto* s = dynamic_cast<sw::distributed::Sharded<torch::optim::SGD>*>(&opt)) {
    return s->clip_grad_norm_(max_norm);
  }
  return dynamic_cast<sw::distributed::Sharded<torch::optim::Adam>&>(opt).clip_grad_norm_(max_norm);
}

// What a trained 2 x 2 pipe gives back: its losses, the layers of this rank's stages, and how
// many parameters hold optimizer state here and how many this replica owns.
struct Trained {
  std::vector<torch::Tensor> losses;
  std::vector<std::size_t> layers;
  std::size_t state = 0, owned = 0;
};

// One 2 x 2 pipe of `cfg` (sharded or not) over `seq`, trained three steps.
template <class Schedule>
Trained train(const sw::runtime::Connection& c, const Config& cfg, const Schedule& s, bool shard,
              torch::nn::Sequential& seq) {
  const auto b = cfg.virtual_stages == 2 ? sw::balance{2, 2, 2, 2} : sw::balance{4, 4};
  auto dist = sw::distributed::Options()
                  .data_parallel(2)
                  .virtual_stages(cfg.virtual_stages)
                  .bucket_bytes(200)  // several buckets per stage
                  .shard_optimizer_state(shard)
                  .shard_gradients(shard && cfg.each_pass)
                  .reduce_scatter(cfg.how)
                  .transport(sw::runtime::C10dOptions()
                                 .prefix(cfg.name + (shard ? "/sharded" : "/plain"))
                                 .timeout(20s));
  if constexpr (sched::placed_schedule<Schedule>) dist.placed_like(s);
  sw::distributed::Pipe pipe(c, seq, b, sw::PipeOptions().chunks(3).checkpoint(cfg.mode), dist);
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<sw::optim::FusedStep> fused;
  if (cfg.fused) {
    fused = fused_of(cfg.kind, pipe);
  } else {
    opt = shard ? sharded(cfg.kind, pipe) : unsharded_opt(cfg.kind, pipe->parameters());
  }
  sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().enabled(cfg.scaler));
  Trained out;
  zpipe::armed_calls() = 0;  // a rank without the Poison's stage never disarms it
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    const auto in = pipe->has_stage(0) ? pipe->shard(x) : torch::Tensor();
    const auto target = pipe->has_stage(pipe->num_stages() - 1) ? pipe->shard(y) : torch::Tensor();
    if (cfg.scaler && step == 1 && pipe->replica() == 1) zpipe::armed_calls() = 1;
    torch::Tensor loss;
    if (fused) {
      auto run = [&] {
        loss = cfg.scaler ? pipe->train_step(in, target, mse, *fused, scaler, s)
                          : pipe->train_step(in, target, mse, *fused, s);
      };
      if (cfg.clip > 0 && cfg.scaler) {
        pipe->clip_grad_norm_step(*fused, run, cfg.clip, scaler);
      } else if (cfg.clip > 0) {
        pipe->clip_grad_norm_step(*fused, run, cfg.clip);
      } else {
        run();
      }
    } else if (cfg.twice) {
      // Each half of the replica's rows, both reduced; the averages add up (then halved by the
      // losses' weights: loss_fn over half the rows, times 1/2).
      const auto half = [&](const torch::Tensor& t, int k) {
        return t.defined() ? t.narrow(0, k * t.size(0) / 2, t.size(0) / 2) : t;
      };
      auto halved = [](const torch::Tensor& o, const torch::Tensor& t) {
        return torch::mse_loss(o, t) / 2;
      };
      loss = pipe->train_step(half(in, 0), half(target, 0), halved, s) +
             pipe->train_step(half(in, 1), half(target, 1), halved, s);
      opt->step();
      opt->zero_grad();
    } else {
      loss = cfg.scaler ? pipe->train_step(in, target, mse, scaler, s)
                        : pipe->train_step(in, target, mse, s);
      if (cfg.scaler) scaler.unscale_(*opt);
      if (cfg.clip > 0) clip_of(*opt, cfg.clip);
      if (cfg.scaler) {
        scaler.step(*opt);
      } else {
        opt->step();
      }
      opt->zero_grad();
    }
    if (cfg.scaler) scaler.update();
    out.losses.push_back(loss.detach());
  }
  pipe->wait_parameters();
  if (opt) out.state = opt->state().size();
  for (std::size_t i = 0; fused && i < fused->size(); ++i) {
    out.state += fused->optimizer(i).state().empty() ? 0 : 1;
  }
  out.owned = pipe->parameters().size();
  if (shard) {
    const auto o = pipe->sharded_parameters().owned;
    out.owned = static_cast<std::size_t>(std::count(o.begin(), o.end(), 1));
  }
  std::size_t layer = 0;
  for (std::size_t j = 0; j < b.size(); ++j) {
    for (int k = 0; k < b[j]; ++k, ++layer) {
      if (pipe->has_stage(static_cast<int>(j))) out.layers.push_back(layer);
    }
  }
  return out;
}

// The largest relative difference seen, against the one-process pipe.
double& largest() {
  static double d = 0;
  return d;
}

// Trains `cfg` sharded, unsharded and in one process; checks losses and this rank's parameters:
// sharded == unsharded bit for bit, both within 1e-5 of one process; state only where owned.
template <class Schedule>
void compare(const sw::runtime::Connection& c, const Config& cfg, const Schedule& s) {
  const bool first_replica = c.env.rank < 2;
  auto seq = model(first_replica ? 7 : 99);  // replica 1 starts elsewhere: replica 0's are copied
  auto plain_seq = model(first_replica ? 7 : 98);
  const Trained sharded = train(c, cfg, s, true, seq);
  // The unsharded unfused pipe has no whole-model clip to compare with.
  const bool unsharded = cfg.fused || cfg.clip == 0;
  const Trained plain = unsharded ? train(c, cfg, s, false, plain_seq) : Trained{};
  // One process, the whole global batch, the unfused optimizer.
  auto ref_seq = model();
  const auto b = cfg.virtual_stages == 2 ? sw::balance{2, 2, 2, 2} : sw::balance{4, 4};
  auto ref = sw::Pipe(ref_seq, b, sw::PipeOptions().chunks(3).checkpoint(cfg.mode));
  auto ref_opt = unsharded_opt(cfg.kind, ref->parameters());
  sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().enabled(cfg.scaler));
  std::vector<torch::Tensor> ref_losses;
  zpipe::armed_calls() = 0;
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    if (cfg.scaler && step == 1) zpipe::armed_calls() = 1;
    if (cfg.twice) {  // each replica's half of its rows, both halves of the global batch
      auto halved = [](const torch::Tensor& o, const torch::Tensor& t) {
        return torch::mse_loss(o, t) / 2;
      };
      auto rows = [](const torch::Tensor& t, int k) {
        // Replica r's half k: rows [r * 6 + k * 3, + 3) of 12.
        return torch::cat({t.narrow(0, k * 3, 3), t.narrow(0, 6 + k * 3, 3)});
      };
      ref_losses.push_back(ref->train_step(rows(x, 0), rows(y, 0), halved, s) +
                           ref->train_step(rows(x, 1), rows(y, 1), halved, s));
    } else {
      ref_losses.push_back(cfg.scaler ? ref->train_step(x, y, mse, scaler, s)
                                      : ref->train_step(x, y, mse, s));
    }
    if (cfg.scaler) scaler.unscale_(*ref_opt);
    if (cfg.clip > 0) torch::nn::utils::clip_grad_norm_(ref->parameters(), cfg.clip);
    if (cfg.scaler) {
      scaler.step(*ref_opt);
      scaler.update();
    } else {
      ref_opt->step();
    }
    ref_opt->zero_grad();
  }
  auto check = [&](bool ok, const std::string& what) { TORCH_CHECK(ok, cfg.name, ": ", what); };
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor& l = sharded.losses[static_cast<std::size_t>(step)];
    // Reduced every pass (or twice a step), the sums come in another order: equal up to rounding.
    const auto& p = plain.losses[static_cast<std::size_t>(step)];
    const bool rounding = cfg.each_pass || cfg.twice;
    check(!unsharded || (rounding ? torch::allclose(l, p, 1e-6, 0) : torch::equal(l, p)),
          "the loss of step " + std::to_string(step) + " differs from the unsharded pipe's");
    const torch::Tensor& r = ref_losses[static_cast<std::size_t>(step)];
    const double diff = (l - r).abs().item<double>() / std::max(r.abs().item<double>(), 1e-6);
    check(diff <= 1e-5, "the loss of step " + std::to_string(step) +
                            " differs from one "
                            "process's by " +
                            std::to_string(diff));
  }
  check(sharded.state <= sharded.owned, "state for " + std::to_string(sharded.state) +
                                            " parameters, " + std::to_string(sharded.owned) +
                                            " owned");
  for (const std::size_t l : sharded.layers) {
    const std::vector<torch::Tensor> mine = seq[l]->parameters(),
                                     theirs = plain_seq[l]->parameters(),
                                     whole = ref_seq[l]->parameters();
    for (std::size_t p = 0; p < mine.size(); ++p) {
      const auto what = "layer " + std::to_string(l) + " parameter " + std::to_string(p);
      if (cfg.each_pass || cfg.twice) {
        const double scale = std::max(theirs[p].abs().max().item<double>(), 1e-6);
        const double diff = (mine[p] - theirs[p]).abs().max().item<double>() / scale;
        check(diff <= 1e-6, what + " differs from the unsharded pipe's by " + std::to_string(diff));
      } else {
        check(!unsharded || torch::equal(mine[p], theirs[p]),
              what + " differs from the unsharded pipe's");
      }
      const double scale = std::max(whole[p].abs().max().item<double>(), 1e-6);
      const double diff = (mine[p] - whole[p]).abs().max().item<double>() / scale;
      largest() = std::max(largest(), diff);
      check(diff <= 1e-5, what + " differs from one process's by " + std::to_string(diff));
    }
  }
}

}  // namespace zpipe

TEST_SUITE("distributed pipe x data parallel, sharded state") {
  TEST_CASE("2 x 2 sharded equals the unsharded 2 x 2 pipe bit for bit, and one process") {
    auto r = run_ranks(
        zpipe::kRanks,
        [](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          using Cfg = zpipe::Config;
          const auto never = sw::Checkpoint::never, always = sw::Checkpoint::always;
          zpipe::compare(c, Cfg{.name = "gpipe-sgd", .mode = always}, sched::gpipe{});
          zpipe::compare(c, Cfg{.name = "1f1b-adam", .kind = "adam"}, sched::one_f_one_b{});
          zpipe::compare(c, Cfg{.name = "zb-sgd", .mode = never}, sched::zero_bubble_h1{});
          zpipe::compare(c, Cfg{.name = "il-adam", .virtual_stages = 2, .kind = "adam"},
                         sched::interleaved_one_f_one_b{2});
          zpipe::compare(c, Cfg{.name = "fused-1f1b-sgd", .fused = true}, sched::one_f_one_b{});
          zpipe::compare(c,
                         Cfg{.name = "fused-zb-adam", .mode = never, .kind = "adam", .fused = true},
                         sched::zero_bubble_h1{});
          zpipe::compare(c, Cfg{.name = "fused-il-sgd", .virtual_stages = 2, .fused = true},
                         sched::interleaved_one_f_one_b{2});
          zpipe::compare(
              c, Cfg{.name = "fused-clip-adam", .kind = "adam", .fused = true, .clip = 0.05},
              sched::one_f_one_b{});
          zpipe::compare(c, Cfg{.name = "clip-sgd", .clip = 0.05}, sched::zero_bubble_h1{});
          zpipe::compare(c,
                         Cfg{.name = "scaler-adam", .mode = never, .kind = "adam", .scaler = true},
                         sched::one_f_one_b{});
          zpipe::compare(c,
                         Cfg{.name = "fused-scaler-clip-adam",
                             .mode = never,
                             .kind = "adam",
                             .fused = true,
                             .clip = 0.05,
                             .scaler = true},
                         sched::gpipe{});
          zpipe::compare(c,
                         Cfg{.name = "all-to-all-adam",
                             .kind = "adam",
                             .how = sw::runtime::ReduceScatter::all_to_all},
                         sched::one_f_one_b{});
          zpipe::compare(c,
                         Cfg{.name = "all-reduce-fused-sgd",
                             .fused = true,
                             .how = sw::runtime::ReduceScatter::all_reduce},
                         sched::one_f_one_b{});
          zpipe::compare(c, Cfg{.name = "zero2-1f1b-adam", .kind = "adam", .each_pass = true},
                         sched::one_f_one_b{});
          zpipe::compare(c, Cfg{.name = "twice-1f1b-adam", .kind = "adam", .twice = true},
                         sched::one_f_one_b{});
          zpipe::compare(c, Cfg{.name = "zero2-twice-gpipe-sgd", .each_pass = true, .twice = true},
                         sched::gpipe{});
          zpipe::compare(
              c, Cfg{.name = "zero2-fused-zb-sgd", .mode = never, .fused = true, .each_pass = true},
              sched::zero_bubble_h1{});
          zpipe::compare(c,
                         Cfg{.name = "zero2-fused-il-adam",
                             .virtual_stages = 2,
                             .mode = always,
                             .kind = "adam",
                             .fused = true,
                             .each_pass = true},
                         sched::interleaved_one_f_one_b{2});
          zpipe::compare(c,
                         Cfg{.name = "zero2-fused-scaler-clip-adam",
                             .mode = never,
                             .kind = "adam",
                             .fused = true,
                             .clip = 0.05,
                             .scaler = true,
                             .each_pass = true},
                         sched::one_f_one_b{});
          zpipe::compare(c,
                         Cfg{.name = "zero2-all-to-all-sgd",
                             .kind = "sgd",
                             .how = sw::runtime::ReduceScatter::all_to_all,
                             .each_pass = true},
                         sched::gpipe{});
          std::printf("rank %d: largest relative difference to one process %.3g\n", rank,
                      zpipe::largest());
          std::fflush(stdout);
        },
        300s);
    for (std::size_t k = 0; k < r.size(); ++k) {
      CAPTURE(k);
      CHECK(r[k].text == "");
      CHECK(r[k].status == 0);
    }
  }
}
