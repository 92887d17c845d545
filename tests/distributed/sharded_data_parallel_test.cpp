// DataParallel with the optimizer state and gradients sharded over the ranks (ZeRO-2): on 2 and
// 3 ranks, SGD with momentum and Adam, unfused (distributed::Sharded) and fused (step_with),
// with accumulation, clipping by the whole model's norm, a GradScaler's skipped step and unused
// parameters, each equal to the unsharded DataParallel (bit for bit on 2 ranks) and to one
// process on the whole batch; each rank holds state for its own parameters only; saves resume
// bit for bit; bad setups and bad saves are named on every rank.

#include "stagewise/distributed.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace zdp {

constexpr int kSteps = 3;
constexpr int kRows = 12;  // splits evenly over 2 and 3 ranks

// Two heads: `b` only when asked, so that a step can leave its parameters without a gradient.
struct HeadsImpl : torch::nn::Module {
  HeadsImpl()
      : body(register_module("body", torch::nn::Linear(6, 8))),
        a(register_module("a", torch::nn::Linear(8, 3))),
        b(register_module("b", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x, bool use_b) {
    auto h = torch::tanh(body->forward(x));
    return use_b ? a->forward(h) + b->forward(h) : a->forward(h);
  }
  torch::nn::Linear body, a, b;
};
TORCH_MODULE(Heads);

Heads model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return Heads();
}

struct Batch {
  torch::Tensor x, y;
};
std::vector<Batch> data() {
  torch::manual_seed(42);
  std::vector<Batch> d;
  for (int s = 0; s < kSteps; ++s) {
    d.push_back({torch::randn({kRows, 6}), torch::randn({kRows, 3})});
  }
  return d;
}

// How a job trains. `pattern`: "always" uses head b on every rank and step; "odd_steps_off": on
// no rank on odd steps; "rank0_only_on_odd": only rank 0 on odd steps.
struct Run {
  std::string name;
  std::string kind = "adam";  // or "sgd" (with momentum)
  bool fused = false;
  bool accumulate = false;  // two micro-steps, the first under no_sync
  bool twice = false;       // two micro-steps, both reduced (no no_sync), then one step
  std::string pattern = "always";
  double clip = 0;      // > 0: clipped by the whole model's norm
  bool scaler = false;  // a GradScaler; step 1 has an inf in b.bias's gradient on the last rank
  std::int64_t bucket_bytes = 25 << 20;
  bool unused = false;  // unused_parameters(true)
};

bool uses_b(const std::string& pattern, int s, int r) {
  if (pattern == "always" || s % 2 == 0) return true;
  return pattern == "rank0_only_on_odd" && r == 0;
}

std::unique_ptr<torch::optim::Optimizer> plain_optimizer(const std::string& kind,
                                                         std::vector<torch::Tensor> params) {
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(std::move(params),
                                               torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(1e-2));
}

template <class DP>
std::unique_ptr<torch::optim::Optimizer> sharded_optimizer(const std::string& kind, DP& dp) {
  if (kind == "sgd") {
    return std::make_unique<sw::distributed::Sharded<torch::optim::SGD>>(
        dp, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<sw::distributed::Sharded<torch::optim::Adam>>(
      dp, torch::optim::AdamOptions(1e-2));
}

sw::optim::FusedStep fused_optimizer(const std::string& kind, Heads& m) {
  if (kind == "sgd") {
    return sw::optim::FusedStep(m->named_parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return sw::optim::FusedStep(m->named_parameters(), torch::optim::AdamOptions(1e-2));
}

// How a loss reaches the model: DataParallel's forward and mark on a rank, the module's own in
// the one-process reference.
struct Forward {
  std::function<torch::Tensor(const torch::Tensor&, bool)> forward;
  std::function<torch::Tensor(const torch::Tensor&)> mark = [](const torch::Tensor& t) {
    return t;
  };
};

// The loss of rows x, y at step s on rank r (of `world`); with the scaler's inf in b.bias's
// gradient at step 1 of the last rank.
torch::Tensor loss_of(const Forward& f, Heads& m, const Run& run, const torch::Tensor& x,
                      const torch::Tensor& y, int s, int r, int world) {
  auto loss = torch::mse_loss(f.forward(x, uses_b(run.pattern, s, r)), y);
  if (run.scaler && s == 1 && r == world - 1) {
    loss = loss + f.mark(m->b->bias.sum() * std::numeric_limits<float>::infinity());
  }
  return loss;
}

// One step of `run` on this rank: forward and backward of its rows (two micro-steps with
// accumulation), then the (clipped, scaled) optimizer step.
void step(sw::distributed::DataParallel<Heads>& dp, Heads& m, const Run& run, int s, int rank,
          int world, const Batch& b, torch::optim::Optimizer* opt, sw::optim::FusedStep* fused,
          sw::amp::GradScaler& scaler) {
  const auto x = dp.shard(b.x), y = dp.shard(b.y);
  const Forward f{[&](const torch::Tensor& in, bool use_b) { return dp.forward(in, use_b); },
                  [&](const torch::Tensor& t) { return dp.mark(t); }};
  auto backward = [&] {
    auto scaled = [&](const torch::Tensor& l) { return run.scaler ? scaler.scale(l) : l; };
    if (run.accumulate || run.twice) {
      const auto half = x.size(0) / 2;
      auto first = [&] {
        scaled(loss_of(f, m, run, x.narrow(0, 0, half), y.narrow(0, 0, half), s, rank, world) / 2)
            .backward();
      };
      if (run.accumulate) {
        auto local = dp.no_sync();
        first();
      } else {
        first();  // reduced: the second adds to the owners' averages
      }
      scaled(loss_of(f, m, run, x.narrow(0, half, half), y.narrow(0, half, half), s, rank, world) /
             2)
          .backward();
    } else {
      scaled(loss_of(f, m, run, x, y, s, rank, world)).backward();
    }
  };
  if (fused != nullptr) {
    if (run.clip > 0 && run.scaler) {
      sw::optim::clip_grad_norm_step(*fused, backward, run.clip, scaler);
    } else if (run.clip > 0) {
      sw::optim::clip_grad_norm_step(*fused, backward, run.clip);
    } else if (run.scaler) {
      scaler.step(*fused, backward);
    } else {
      backward();
    }
  } else {
    for (auto& p : m->parameters()) p.mutable_grad().reset();
    backward();
    if (run.scaler) scaler.unscale_(*opt);
    if (run.clip > 0) {
      if (auto* sgd = dynamic_cast<sw::distributed::Sharded<torch::optim::SGD>*>(opt)) {
        sgd->clip_grad_norm_(run.clip);
      } else if (auto* adam = dynamic_cast<sw::distributed::Sharded<torch::optim::Adam>*>(opt)) {
        adam->clip_grad_norm_(run.clip);
      } else {
        torch::nn::utils::clip_grad_norm_(m->parameters(), run.clip);
      }
    }
    if (run.scaler) {
      scaler.step(*opt);
    } else {
      opt->step();
    }
  }
  if (run.scaler) scaler.update();
}

// One process on the whole batch, as the ranks train (each rank's rows weighted by its share).
Heads reference(const Run& run, int world) {
  auto m = model(1);
  auto opt = plain_optimizer(run.kind, m->parameters());
  sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().enabled(run.scaler));
  const auto d = data();
  const Forward f{[&](const torch::Tensor& in, bool use_b) { return m->forward(in, use_b); }};
  for (int s = 0; s < kSteps; ++s) {
    for (auto& p : m->parameters()) p.mutable_grad().reset();
    const auto rows = kRows / world;
    torch::Tensor loss;
    for (int r = 0; r < world; ++r) {
      const auto x = d[s].x.narrow(0, r * rows, rows), y = d[s].y.narrow(0, r * rows, rows);
      torch::Tensor part;
      if (run.accumulate || run.twice) {
        const auto half = rows / 2;
        part =
            loss_of(f, m, run, x.narrow(0, 0, half), y.narrow(0, 0, half), s, r, world) / 2 +
            loss_of(f, m, run, x.narrow(0, half, half), y.narrow(0, half, half), s, r, world) / 2;
      } else {
        part = loss_of(f, m, run, x, y, s, r, world);
      }
      part = part / world;
      loss = loss.defined() ? loss + part : part;
    }
    (run.scaler ? scaler.scale(loss) : loss).backward();
    if (run.scaler) scaler.unscale_(*opt);
    if (run.clip > 0) torch::nn::utils::clip_grad_norm_(m->parameters(), run.clip);
    if (run.scaler) {
      scaler.step(*opt);
      scaler.update();
    } else {
      opt->step();
    }
  }
  return m;
}

// The largest relative difference of a parameter: max |a - b| / max |b| over each tensor.
double worst(Heads& got, Heads& want) {
  double w = 0;
  auto g = got->parameters(), r = want->parameters();
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double scale = std::max(r[i].abs().max().item<double>(), 1e-6);
    w = std::max(w, (g[i] - r[i]).abs().max().item<double>() / scale);
  }
  return w;
}
bool same(Heads& a, Heads& b) {
  auto x = a->parameters(), y = b->parameters();
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!torch::equal(x[i], y[i])) return false;
  }
  return true;
}
std::string digest(Heads& m) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& p : m->parameters()) {
    const auto c = p.detach().contiguous();
    const auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (std::size_t k = 0; k < c.nbytes(); ++k) h = (h ^ b[k]) * 1099511628211ull;
  }
  return std::to_string(h);
}

// How many of the optimizer's (or fused step's) parameters have state.
std::size_t with_state(torch::optim::Optimizer* opt, sw::optim::FusedStep* fused) {
  if (opt != nullptr) return opt->state().size();
  std::size_t n = 0;
  for (std::size_t i = 0; i < fused->size(); ++i) n += fused->optimizer(i).state().empty() ? 0 : 1;
  return n;
}

// Trains `run` on this rank, sharded or not; returns the model, and in `state` how many
// parameters hold optimizer state here and in `owned` how many this rank owns.
Heads train(const sw::runtime::Connection& c, const Run& run, bool sharded, std::size_t& state,
            std::size_t& owned) {
  const int rank = c.env.rank, world = c.env.world_size;
  auto m = model(rank == 0 ? 1 : 100 + rank);  // rank 0's parameters reach every rank
  sw::distributed::DataParallel dp(c, m,
                                   sw::distributed::DataParallelOptions()
                                       .timeout(10s)
                                       .bucket_bytes(run.bucket_bytes)
                                       .unused_parameters(run.unused)
                                       .shard_optimizer_state(sharded));
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::optional<sw::optim::FusedStep> fused;
  if (run.fused) {
    fused.emplace(fused_optimizer(run.kind, m));
    dp.step_with(*fused);
  } else if (sharded) {
    opt = sharded_optimizer(run.kind, dp);
  } else {
    opt = plain_optimizer(run.kind, m->parameters());
  }
  sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().enabled(run.scaler));
  const auto d = data();
  for (int s = 0; s < kSteps; ++s) {
    step(dp, m, run, s, rank, world, d[s], opt.get(), fused ? &*fused : nullptr, scaler);
  }
  state = with_state(opt.get(), fused ? &*fused : nullptr);
  owned = sharded ? dp.owned_parameters().size() : m->parameters().size();
  return m;
}

}  // namespace zdp

TEST_SUITE("sharded data parallel") {
  TEST_CASE("sharded state equals the unsharded DataParallel and one process, on 2 and 3 ranks") {
    std::vector<zdp::Run> runs;
    for (const std::string kind : {"sgd", "adam"}) {
      runs.push_back({.name = kind, .kind = kind});
      runs.push_back({.name = "fused " + kind, .kind = kind, .fused = true});
    }
    runs.push_back({.name = "adam, one-parameter buckets", .bucket_bytes = 4});
    runs.push_back({.name = "sgd, accumulation", .kind = "sgd", .accumulate = true});
    runs.push_back({.name = "adam, two reducing backwards, one step", .twice = true});
    runs.push_back({.name = "fused adam, accumulation", .fused = true, .accumulate = true});
    runs.push_back({.name = "adam, clipped", .clip = 0.05});
    runs.push_back({.name = "fused sgd, clipped", .kind = "sgd", .fused = true, .clip = 0.05});
    runs.push_back({.name = "adam, scaler", .scaler = true});
    runs.push_back(
        {.name = "fused adam, scaler, clipped", .fused = true, .clip = 0.05, .scaler = true});
    runs.push_back({.name = "adam, head b unused on odd steps", .pattern = "odd_steps_off"});
    runs.push_back({.name = "fused sgd, head b on rank 0 only on odd steps",
                    .kind = "sgd",
                    .fused = true,
                    .pattern = "rank0_only_on_odd",
                    .unused = true});
    for (const int world : {2, 3}) {
      CAPTURE(world);
      const auto r = run_ranks(
          world,
          [&](int) {
            auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {10s});
            std::ostringstream out;
            double most_unsharded = 0, most_one = 0;
            for (const auto& run : runs) {
              std::size_t state = 0, owned = 0, all = 0, all_owned = 0;
              auto sharded = zdp::train(c, run, true, state, owned);
              auto unsharded = zdp::train(c, run, false, all, all_owned);
              auto want = zdp::reference(run, world);
              const bool equal = zdp::same(sharded, unsharded);
              const double to_unsharded = zdp::worst(sharded, unsharded);
              const double to_one = zdp::worst(sharded, want);
              // Bit for bit on 2 ranks (a + b == b + a); within rounding on 3, and where a
              // reduction adds to an earlier one's average (the unsharded one sums it d times).
              if ((world == 2 && !equal && !run.twice) || to_unsharded > 1e-6 || to_one > 1e-5 ||
                  state > owned) {
                out << run.name << ": equal " << equal << ", to unsharded " << to_unsharded
                    << ", to one process " << to_one << ", state " << state << " of " << owned
                    << " owned;";
              }
              out << zdp::digest(sharded) << " ";
              most_unsharded = std::max(most_unsharded, to_unsharded);
              most_one = std::max(most_one, to_one);
            }
            char worst[128];
            std::snprintf(worst, sizeof worst,
                          "| largest relative difference %.3g to unsharded, "
                          "%.3g to one process",
                          most_unsharded, most_one);
            report(out.str() + worst);
          },
          120s);
      for (const auto& o : r) {
        INFO(o.text);
        CHECK(o.status == 0);
        CHECK(o.text == r[0].text);  // every rank took the same steps, and none failed a check
        CHECK(!contains(o.text, ";"));
      }
      MESSAGE(world << " ranks: " << r[0].text.substr(r[0].text.find('|')));
    }
  }

  TEST_CASE("each rank keeps state for its own parameters only, and frees the others' gradients") {
    const auto r = run_ranks(
        2,
        [](int rank) {
          auto m = zdp::model(1);
          sw::distributed::DataParallel dp(
              m, sw::distributed::DataParallelOptions().timeout(10s).shard_optimizer_state(true));
          sw::distributed::Sharded<torch::optim::Adam> adam(dp, torch::optim::AdamOptions(1e-2));
          const auto d = zdp::data();
          torch::mse_loss(dp.forward(dp.shard(d[0].x), true), dp.shard(d[0].y)).backward();
          // Owners: whole tensors by size, largest first, each to the lighter rank.
          std::vector<std::int64_t> bytes;
          for (const auto& p : m->parameters()) bytes.push_back(p.numel() * p.element_size());
          const auto owners = sw::optim::shard_owners(bytes, 2);
          std::ostringstream out;
          const auto params = m->named_parameters();
          for (std::size_t i = 0; i < params.size(); ++i) {
            const bool mine = owners[i] == rank;
            const bool listed = std::any_of(
                adam.param_groups()[0].params().begin(), adam.param_groups()[0].params().end(),
                [&](const torch::Tensor& p) { return p.is_same(params[i].value()); });
            if (mine != listed || mine != params[i].value().grad().defined()) {
              out << params[i].key() << " owner " << owners[i] << " listed " << listed << " grad "
                  << params[i].value().grad().defined() << "; ";
            }
          }
          adam.step();
          if (adam.state().size() != dp.owned_parameters().size()) out << "state of others; ";
          // After the step every rank holds every owner's update.
          out << zdp::digest(m);
          report(out.str());
        },
        60s);
    for (const auto& o : r) {
      INFO(o.text);
      CHECK(o.status == 0);
      CHECK(!contains(o.text, ";"));
      CHECK(o.text == r[0].text);
    }
  }

  TEST_CASE("a sharded backward without a sharded optimizer or a fused step is refused") {
    const auto r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {10s});
          auto m = zdp::model(1);
          sw::distributed::DataParallel dp(
              c, m, sw::distributed::DataParallelOptions().shard_optimizer_state(true));
          // A plain optimizer would step this rank's shard and send nothing to the others.
          torch::optim::SGD plain(m->parameters(), torch::optim::SGDOptions(0.1));
          const auto d = zdp::data();
          report(error_of([&] {
            torch::mse_loss(dp.forward(dp.shard(d[0].x), true), dp.shard(d[0].y)).backward();
          }));
        },
        60s);
    for (const auto& o : r) {
      INFO(o.text);
      CHECK(o.status == 0);
      CHECK(contains(o.text, "stagewise::distributed::DataParallel: the gradients were reduced "
                             "to their owners (the optimizer state is sharded), but no optimizer "
                             "will send the owners' updates to the other ranks, which would go "
                             "on with the old values: step with distributed::Sharded<Optimizer> "
                             "(built before the first backward; its step() sends them) or a "
                             "fused step, not a plain LibTorch optimizer"));
    }
  }

  TEST_CASE("a sharded optimizer saves its shard and resumes bit for bit; bad saves are named") {
    const char* tmp = std::getenv("TEST_TMPDIR");
    const auto dir =
        std::filesystem::path(tmp ? tmp : "/tmp") / ("stagewise_zdp_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    const auto r = run_ranks(
        2,
        [&](int rank) {
          auto m = zdp::model(1);
          sw::distributed::DataParallel dp(
              m, sw::distributed::DataParallelOptions().timeout(10s).shard_optimizer_state(true));
          sw::distributed::Sharded<torch::optim::Adam> adam(dp, torch::optim::AdamOptions(1e-2));
          const auto d = zdp::data();
          auto run = [&](int s) {
            adam.zero_grad();
            torch::mse_loss(dp.forward(dp.shard(d[s].x), true), dp.shard(d[s].y)).backward();
            adam.step();
          };
          run(0);
          const auto mine = (dir / ("opt" + std::to_string(rank) + ".pt")).string();
          torch::save(adam, mine);
          torch::save(m, (dir / ("model" + std::to_string(rank) + ".pt")).string());
          run(1);
          run(2);
          const auto want = zdp::digest(m);
          // Resume: the model and this rank's shard of the state.
          torch::load(m, (dir / ("model" + std::to_string(rank) + ".pt")).string());
          torch::load(adam, mine);
          run(1);
          run(2);
          std::string out = zdp::digest(m) == want ? "resumed" : "differs";
          // The other rank's save holds state for its parameters, none for this rank's.
          const auto other = (dir / ("opt" + std::to_string(1 - rank) + ".pt")).string();
          out += "\n" + error_of([&] { torch::load(adam, other); });
          // A save of another model.
          torch::nn::Linear lin(6, 8);
          torch::optim::Adam small(lin->parameters(), torch::optim::AdamOptions(1e-2));
          torch::save(small, (dir / ("small" + std::to_string(rank) + ".pt")).string());
          out += "\n" + error_of([&] {
                   torch::load(adam, (dir / ("small" + std::to_string(rank) + ".pt")).string());
                 });
          // An unsharded Adam over every parameter loads a shard's save: the owned state.
          torch::optim::Adam whole(m->parameters(), torch::optim::AdamOptions(1e-2));
          torch::load(whole, mine);
          out += "\nunsharded " + std::to_string(whole.state().size()) + " of " +
                 std::to_string(adam.state().size());
          report(out);
        },
        60s);
    std::filesystem::remove_all(dir);
    for (int k = 0; k < 2; ++k) {
      const auto& text = r[static_cast<std::size_t>(k)].text;
      INFO(text);
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
      CHECK(text.starts_with("resumed\n"));
      CHECK(contains(text,
                     "stagewise::distributed::DataParallel (Sharded::load): the archive holds "
                     "optimizer state, but none for '"));
      CHECK(contains(text,
                     "which this replica owns: it was saved by another replica or for another "
                     "model. Load each replica's own save (same model and replica count), or an "
                     "unsharded optimizer's; nothing was loaded"));
      CHECK(contains(text,
                     "stagewise::distributed::DataParallel (Sharded::load): the archive is not an "
                     "optimizer's over these 6 parameters ("));
      CHECK(contains(text, "); it was saved for another model or stage; nothing was loaded"));
    }
    CHECK(contains(r[0].text, "\nunsharded 2 of 2"));  // body.weight, body.bias on rank 0
    CHECK(contains(r[1].text, "\nunsharded 4 of 4"));
  }

  TEST_CASE(
      "ranks that shard differently, and a sharded optimizer over unsharded state, are named") {
    auto r = run_ranks(
        2,
        [](int rank) {
          auto m = zdp::model(1);
          sw::distributed::DataParallel dp(
              m,
              sw::distributed::DataParallelOptions().timeout(10s).shard_optimizer_state(rank == 0));
        },
        60s);
    const std::string text =
        "stagewise::distributed::DataParallel: ranks 0 and 1 shard the optimizer state "
        "differently: rank 0 {sharded over 2 ranks, reduce_scatter reduce, owners 0 0 1 1 1 1}, "
        "rank 1 {not sharded}; give every rank the same "
        "DataParallelOptions().shard_optimizer_state(...) and reduce_scatter(...) and the same "
        "model (and stagewise build)";
    CHECK(r[0].text == text);
    CHECK(r[1].text == text);
    r = run_ranks(
        2,
        [](int) {
          auto m = zdp::model(1);
          sw::distributed::DataParallel dp(m, sw::distributed::DataParallelOptions().timeout(10s));
          report(error_of([&] {
            sw::distributed::Sharded<torch::optim::SGD> sgd(dp, torch::optim::SGDOptions(0.1));
          }));
        },
        60s);
    CHECK(r[1].text ==
          "stagewise::distributed::DataParallel: the optimizer state is not sharded; build "
          "DataParallel with DataParallelOptions().shard_optimizer_state(true), or use an "
          "unsharded optimizer");
  }
}
