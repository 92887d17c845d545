// Saves of a 2-D pipe with sharded optimizer state: every rank saves its replica's shard; a 2 x 2
// job killed mid-step resumes from its last save bit for bit (the sharded Adam and the sharded
// fused Adam); a shard's save loaded by another replica, ranks that shard differently, sharding
// one replica and a sharded optimizer over an unsharded pipe are named; a save at 2 replicas
// resumes at 1 and at 3 (each replica's share of the state is its own file of the save).

#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace fs = std::filesystem;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace zsave {

constexpr int kSteps = 5;
constexpr int kRows = 12;  // splits over 1, 2 and 3 replicas

// Dropout in both stages (each rank draws from its own process's generator), or none.
torch::nn::Sequential model(std::uint64_t seed, bool dropout = true) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(),
                               torch::nn::Dropout(dropout ? 0.2 : 0.0), torch::nn::Linear(8, 8),
                               torch::nn::ReLU(), torch::nn::Dropout(dropout ? 0.3 : 0.0),
                               torch::nn::Linear(8, 3));
}

fs::path scratch(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  auto dir = fs::path(tmp ? tmp : fs::temp_directory_path().string()) /
             ("sharded_resume_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  return dir;
}

// This rank's parameters, every value exactly (hex floats).
std::string values(torch::nn::Module& m) {
  std::string out;
  char v[32];
  for (const auto& p : m.parameters()) {
    const auto c = p.detach().to(torch::kDouble).contiguous();
    for (std::int64_t i = 0; i < c.numel(); ++i) {
      std::snprintf(v, sizeof v, "%a ", c.data_ptr<double>()[i]);
      out += v;
    }
  }
  return out;
}

// The largest relative difference between two `values` texts (max |a - b| / max |b|).
double difference(const std::string& a, const std::string& b) {
  std::istringstream x(a), y(b);
  double most = 0, scale = 1e-12;
  for (std::string u, w; x >> u && y >> w;) {
    const double p = std::strtod(u.c_str(), nullptr), q = std::strtod(w.c_str(), nullptr);
    most = std::max(most, std::abs(p - q));
    scale = std::max(scale, std::abs(q));
  }
  return most / scale;
}

// FNV-1a over the bytes of this rank's parameters and buffers.
std::string digest(torch::nn::Module& m) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](const torch::Tensor& t) {
    const auto c = t.detach().contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (std::size_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  };
  for (const auto& p : m.parameters()) mix(p);
  for (const auto& b : m.buffers()) mix(b);
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

// One rank of a 2 x `replicas` job with sharded Adam (fused or not): `kill_at`, the step in
// which the last rank kills itself at its second micro-batch's loss; `root`, where every step is
// saved; `resume`, the save to start from.
struct Job {
  bool fused = false;
  int replicas = 2;
  int kill_at = -1;
  fs::path root = {};
  fs::path resume = {};
  bool dropout = true;
  bool exact = false;  // report every value (else a digest)

  void run(int rank) const {
    sw::distributed::Pipe pipe(model(resume.empty() ? 1 : 2, dropout), sw::balance{3, 4},
                               sw::PipeOptions().chunks(2).checkpoint("except_last"),
                               sw::distributed::Options()
                                   .data_parallel(replicas)
                                   .shard_optimizer_state(replicas > 1)
                                   .timeout(10s));
    std::unique_ptr<torch::optim::Optimizer> adam;
    std::unique_ptr<sw::optim::FusedStep> fused_step;
    if (fused) {
      fused_step = std::make_unique<sw::optim::FusedStep>(pipe->parameters(),
                                                          torch::optim::AdamOptions(1e-2));
    } else if (replicas > 1) {
      adam = std::make_unique<sw::distributed::Sharded<torch::optim::Adam>>(
          pipe, torch::optim::AdamOptions(1e-2));
    } else {
      adam =
          std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-2));
    }
    torch::manual_seed(99);
    std::vector<torch::Tensor> x, y;
    for (int s = 0; s < kSteps; ++s) {
      x.push_back(torch::randn({kRows, 6}));
      y.push_back(torch::randn({kRows, 3}));
    }
    torch::manual_seed(5 + rank);
    int first = 0;
    if (!resume.empty()) {
      first = static_cast<int>(fused ? pipe->load(resume.string(), *fused_step)
                                     : pipe->load(resume.string(), *adam)) +
              1;
    }
    const int last_rank = 2 * replicas - 1;
    for (int s = first; s < kSteps; ++s) {
      int losses = 0;
      auto loss_fn = [&](const torch::Tensor& out, const torch::Tensor& target) {
        if (rank == last_rank && s == kill_at && ++losses == 2) ::raise(SIGKILL);
        return torch::mse_loss(out, target);
      };
      const auto in = pipe->shard(x[static_cast<std::size_t>(s)]);
      const auto target = pipe->shard(y[static_cast<std::size_t>(s)]);
      if (fused) {
        pipe->train_step(in, target, loss_fn, *fused_step, sw::schedule::one_f_one_b{});
      } else {
        adam->zero_grad();
        pipe->train_step(in, target, loss_fn, sw::schedule::one_f_one_b{});
        adam->step();
      }
      if (!root.empty()) {
        const auto dir = (root / ("step-" + std::to_string(s))).string();
        if (fused) {
          pipe->save(dir, *fused_step, s);
        } else {
          pipe->save(dir, *adam, s);
        }
      }
    }
    pipe->wait_parameters();
    report(exact ? values(*pipe) : digest(*pipe));
  }
};

// The newest save under `root` that all `ranks` ranks completed.
fs::path last_complete_save(const fs::path& root, int ranks) {
  fs::path best;
  long best_step = -1;
  for (const auto& entry : fs::directory_iterator(root)) {
    const auto name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0) continue;
    bool complete = true;
    for (int r = 0; r < ranks; ++r) {
      complete = complete && fs::exists(entry.path() / ("rank" + std::to_string(r) + ".pt"));
    }
    const long step = std::stol(name.substr(5));
    if (complete && step > best_step) {
      best_step = step;
      best = entry.path();
    }
  }
  return best;
}

}  // namespace zsave

TEST_SUITE("distributed pipe x data parallel, sharded saves") {
  TEST_CASE("a 2 x 2 sharded job killed mid-step resumes from its last save bit for bit") {
    for (const bool fused : {false, true}) {
      CAPTURE(fused);
      const auto root = zsave::scratch(fused ? "fused" : "unfused");
      const auto whole = run_ranks(
          4, [&](int rank) { zsave::Job{.fused = fused}.run(rank); }, 120s);
      for (const auto& o : whole) REQUIRE(o.status == 0);
      const auto killed = run_ranks(
          4, [&](int rank) { zsave::Job{.fused = fused, .kill_at = 3, .root = root}.run(rank); },
          120s);
      CHECK(killed[3].status == -SIGKILL);
      for (int k = 0; k < 3; ++k) {
        const auto& o = killed[static_cast<std::size_t>(k)];
        INFO(o.text);
        CHECK(o.status == 1);
        CHECK_FALSE(o.timed_out);
        CHECK(contains(o.text, "rank 3"));
      }
      const auto last = zsave::last_complete_save(root, 4);
      CHECK(last.filename() == "step-2");
      const auto resumed = run_ranks(
          4, [&](int rank) { zsave::Job{.fused = fused, .resume = last}.run(rank); }, 120s);
      for (std::size_t k = 0; k < resumed.size(); ++k) {
        CAPTURE(k);
        INFO(resumed[k].text);
        CHECK(resumed[k].status == 0);
        CHECK(resumed[k].text == whole[k].text);
      }
    }
  }

  TEST_CASE("a job saved at 2 replicas resumes at 1 and at 3") {
    const auto root = zsave::scratch("replicas");
    // The 2-replica job, uninterrupted, saving every step; no dropout: 1, 2 and 3 replicas then
    // compute the same step but for the order of summation.
    const auto saved = run_ranks(
        4, [&](int rank) { zsave::Job{.root = root, .dropout = false, .exact = true}.run(rank); },
        120s);
    for (const auto& o : saved) REQUIRE(o.status == 0);
    // Steps 3 and 4 from step 2's save, at 1 and at 3 replicas, against the 2-replica job's end.
    for (const int d : {1, 3}) {
      CAPTURE(d);
      const auto resumed = run_ranks(
          2 * d,
          [&](int rank) {
            zsave::Job{.replicas = d, .resume = root / "step-2", .dropout = false, .exact = true}
                .run(rank);
          },
          120s);
      for (std::size_t k = 0; k < resumed.size(); ++k) {
        INFO(resumed[k].text);
        CHECK(resumed[k].status == 0);
        // Rank k runs stage k % 2, as ranks 0 and 1 of the 2-replica job.
        CHECK(zsave::difference(resumed[k].text, saved[k % 2].text) < 1e-6);
      }
    }
  }

  TEST_CASE("ranks that shard differently, one replica and a shard's save elsewhere are named") {
    auto r = run_ranks(
        4,
        [](int rank) {
          report(error_of([&] {
            sw::distributed::Pipe pipe(
                zsave::model(1), sw::balance{3, 4}, {},
                sw::distributed::Options().data_parallel(2).shard_optimizer_state(rank < 2).timeout(
                    10s));
          }));
        },
        60s);
    for (int k = 0; k < 4; ++k) {
      const auto& text = r[static_cast<std::size_t>(k)].text;
      INFO(text);
      CHECK(text.starts_with(
          "stagewise::distributed::Pipe: ranks 0 and 2 shard the optimizer state of "
          "their stages differently: rank 0 {stage 0: sharded over 2 ranks, reduce_scatter "
          "reduce, owners 0 1; }, rank 2 {stage 0: not sharded; }; give every rank the same "
          "distributed::Options().shard_optimizer_state(...) and reduce_scatter(...)"));
    }
    r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {10s});
          report(error_of([&] {
            sw::distributed::Pipe pipe(c, zsave::model(1), sw::balance{3, 4}, {},
                                       sw::distributed::Options().shard_optimizer_state(true));
          }));
          sw::distributed::Pipe pipe(c, zsave::model(1), sw::balance{3, 4}, {},
                                     sw::distributed::Options().timeout(10s));
          report("\n" + error_of([&] {
                   sw::distributed::Sharded<torch::optim::SGD> sgd(pipe,
                                                                   torch::optim::SGDOptions(0.1));
                 }));
        },
        60s);
    CHECK(r[0].text ==
          "stagewise::distributed::Pipe: Options().shard_optimizer_state(true) shards each "
          "stage's optimizer state over its data-parallel replicas, but the pipe has one "
          "(data_parallel(1)); set data_parallel(d) with d > 1, or leave it off\n"
          "stagewise::distributed::Pipe: the optimizer state is not sharded; build the pipe with "
          "distributed::Options().data_parallel(d).shard_optimizer_state(true), or use an "
          "unsharded optimizer");
    // A fused step's shard saved by replica 0 and loaded by replica 1's rank of the same stage.
    const auto root = zsave::scratch("elsewhere");
    fs::create_directories(root);
    r = run_ranks(
        4,
        [&](int rank) {
          sw::distributed::Pipe pipe(
              zsave::model(1), sw::balance{3, 4}, sw::PipeOptions().chunks(2),
              sw::distributed::Options().data_parallel(2).shard_optimizer_state(true).timeout(10s));
          sw::optim::FusedStep fused(pipe->named_parameters(), torch::optim::AdamOptions(1e-2));
          torch::manual_seed(3);
          const auto x = torch::randn({zsave::kRows, 6}), y = torch::randn({zsave::kRows, 3});
          auto mse = [](const torch::Tensor& o, const torch::Tensor& t) {
            return torch::mse_loss(o, t);
          };
          pipe->train_step(pipe->shard(x), pipe->shard(y), mse, fused);
          torch::save(fused, (root / ("fused" + std::to_string(rank) + ".pt")).string());
          const auto other = root / ("fused" + std::to_string((rank + 2) % 4) + ".pt");
          // Written by the same stage's rank of the other replica (both have saved when the
          // next step's agreement returns).
          pipe->train_step(pipe->shard(x), pipe->shard(y), mse, fused);
          report(error_of([&] { torch::load(fused, other.string()); }));
        },
        60s);
    for (int k = 0; k < 4; ++k) {
      const auto& text = r[static_cast<std::size_t>(k)].text;
      INFO(text);
      CHECK(text.starts_with(
          "stagewise::optim::FusedStep::load: the archive holds optimizer state, but none for "
          "parameter 'stage"));
      CHECK(contains(text,
                     "which this replica owns; it was saved by another replica or for another "
                     "model. Load each replica's own save (same model, same replica count), or "
                     "an unsharded optimizer's; nothing was loaded"));
    }
  }

  TEST_CASE("a sharded step without a sharded optimizer or a fused step is refused") {
    const auto r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {10s});
          torch::manual_seed(3);
          const auto x = torch::randn({zsave::kRows, 6}), y = torch::randn({zsave::kRows, 3});
          auto mse = [](const torch::Tensor& o, const torch::Tensor& t) {
            return torch::mse_loss(o, t);
          };
          // One stage on 2 replicas: each owns some of the parameters.
          sw::distributed::Pipe pipe(
              c, zsave::model(1, false), sw::balance{7}, sw::PipeOptions().chunks(2),
              sw::distributed::Options().data_parallel(2).shard_optimizer_state(true).timeout(10s));
          // A plain optimizer would step this replica's shard and send nothing.
          torch::optim::Adam adam(pipe->parameters(), torch::optim::AdamOptions(1e-2));
          report(error_of([&] { pipe->train_step(pipe->shard(x), pipe->shard(y), mse); }));
        },
        60s);
    for (int k = 0; k < 2; ++k) {
      const auto& text = r[static_cast<std::size_t>(k)].text;
      INFO(text);
      CHECK(text.find("the gradients were reduced to their owners (the optimizer state is "
                      "sharded), but no optimizer will send the owners' updates to the other "
                      "ranks, which would go on with the old values: step with "
                      "distributed::Sharded<Optimizer> (built before the first backward; its "
                      "step() sends them) or a fused step, not a plain LibTorch optimizer") !=
            std::string::npos);
    }
  }
}
