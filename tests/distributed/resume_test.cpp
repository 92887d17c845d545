// Save and resume across processes: a job killed mid-step and restarted from its last save ends
// bit for bit where a job never interrupted ends (parameters, buffers, optimizer state fused or
// not, random numbers); a failed save fails on every rank and is refused by load. (Resuming
// under other plans: resume_plans_test.cpp.)

#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace fs = std::filesystem;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

constexpr int kSteps = 5;

// Dropout in both stages (one per rank: each draws from its own process's generator).
torch::nn::Sequential model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Dropout(0.2),
                               torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Dropout(0.3),
                               torch::nn::Linear(8, 3));
}

fs::path scratch(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  auto dir = fs::path(tmp ? tmp : fs::temp_directory_path().string()) /
             ("resume_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  return dir;
}

// FNV-1a over the bytes of this rank's parameters and buffers, in order.
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

// One rank's training: a pipe over 2 ranks with Adam, fused or not, on data every rank draws
// alike. `kill_at`: the step in which rank 1 kills itself (SIGKILL) at its second micro-batch's
// loss; `root`: where it saves after every step (empty: no saves); `resume`: the save to start
// from.
struct Job {
  bool fused = false;
  int kill_at = -1;
  fs::path root, resume;

  void run(int rank) const {
    sw::distributed::Pipe pipe(model(resume.empty() ? 1 : 2), sw::balance{3, 4},
                               sw::PipeOptions().chunks(4).checkpoint("except_last"),
                               sw::distributed::Options().timeout(10s));
    std::unique_ptr<torch::optim::Adam> adam;
    std::unique_ptr<sw::optim::FusedStep> fused_step;
    if (fused) {
      fused_step = std::make_unique<sw::optim::FusedStep>(pipe->parameters(),
                                                          torch::optim::AdamOptions(1e-2));
    } else {
      adam =
          std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-2));
    }
    torch::manual_seed(99);
    std::vector<torch::Tensor> x, y;
    for (int s = 0; s < kSteps; ++s) {
      x.push_back(torch::randn({8, 6}));
      y.push_back(torch::randn({8, 3}));
    }
    torch::manual_seed(5);
    int first = 0;
    if (!resume.empty()) {
      first = static_cast<int>(fused ? pipe->load(resume.string(), *fused_step)
                                     : pipe->load(resume.string(), *adam)) +
              1;
    }
    for (int s = first; s < kSteps; ++s) {
      int losses = 0;
      auto loss_fn = [&](const torch::Tensor& out, const torch::Tensor& target) {
        if (rank == 1 && s == kill_at && ++losses == 2) ::raise(SIGKILL);
        return torch::mse_loss(out, target);
      };
      if (fused) {
        pipe->train_step(x[s], y[s], loss_fn, *fused_step, sw::schedule::one_f_one_b{});
      } else {
        adam->zero_grad();
        pipe->train_step(x[s], y[s], loss_fn, sw::schedule::one_f_one_b{});
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
    report(digest(*pipe));
  }
};

}  // namespace

TEST_SUITE("distributed save and resume") {
  TEST_CASE("a job killed mid-step resumes from its last save bit for bit, fused or not") {
    for (const bool fused : {false, true}) {
      CAPTURE(fused);
      const auto root = scratch(fused ? "fused" : "unfused");
      const auto whole = run_ranks(
          2,
          [&](int rank) {
            Job{fused, -1, {}, {}}.run(rank);
          },
          60s);
      REQUIRE(whole[0].status == 0);
      REQUIRE(whole[1].status == 0);

      const auto killed = run_ranks(
          2,
          [&](int rank) {
            Job{fused, /*kill_at=*/3, root, {}}.run(rank);
          },
          60s);
      CHECK(killed[1].status == -SIGKILL);
      CHECK(killed[0].status == 1);
      CHECK_FALSE(killed[0].timed_out);
      INFO(killed[0].text);
      CHECK(contains(killed[0].text, "rank 1"));
      const auto last = sw::latest_save(root.string());  // what a restart script would pick
      REQUIRE(last.has_value());
      CHECK(fs::path(last->dir).filename() == "step-2");
      CHECK(last->step == 2);
      CHECK(last->processes == 2);

      const auto resumed = run_ranks(
          2,
          [&](int rank) {
            Job{fused, -1, {}, last->dir}.run(rank);
          },
          60s);
      INFO(resumed[0].text);
      INFO(resumed[1].text);
      CHECK(resumed[0].status == 0);
      CHECK(resumed[1].status == 0);
      CHECK(resumed[0].text == whole[0].text);
      CHECK(resumed[1].text == whole[1].text);
    }
  }

  TEST_CASE("a save failing on one rank fails on every rank, and is refused by load") {
    const auto root = scratch("failing");
    fs::create_directories(root);
    std::ofstream(root / "a_file") << "not a directory";
    const auto r = run_ranks(
        2,
        [&](int rank) {
          sw::distributed::Pipe pipe(model(1), sw::balance{3, 4}, sw::PipeOptions().chunks(2),
                                     sw::distributed::Options().timeout(10s));
          // Rank 1 saves under a regular file: it cannot make its directory.
          const auto dir = rank == 0 ? root / "ok" : root / "a_file" / "sub";
          const auto saved = error_of([&] { pipe->save(dir.string(), 0); });
          const auto loaded = error_of([&] { pipe->load((root / "ok").string()); });
          report(saved + "\n" + loaded);
        },
        60s);
    CHECK(r[0].status == 0);
    CHECK(r[1].status == 0);
    INFO(r[0].text);
    INFO(r[1].text);
    const std::string cause = "could not save to " + (root / "a_file" / "sub").string() + ": ";
    CHECK(contains(r[0].text, "stagewise::distributed::Pipe::save: rank 1 failed: " + cause));
    CHECK(contains(r[0].text, "; the save in " + (root / "ok").string() +
                                  " is incomplete and cannot be loaded\n"));
    CHECK(contains(r[1].text, "stagewise::distributed::Pipe::save: " + cause));
    // The save under "ok" has rank 0's files but no index: every rank refuses it, naming it.
    const std::string refusal = "stagewise::distributed::Pipe::load: rank 0 failed: " +
                                (root / "ok").string() + " has no " +
                                (root / "ok" / "index.pt").string() +
                                ": the job stopped while saving; resume from an earlier save; "
                                "nothing was loaded";
    CHECK(contains(r[1].text, refusal));
    CHECK(contains(r[0].text, "stagewise::distributed::Pipe::load: " + (root / "ok").string() +
                                  " has no " + (root / "ok" / "index.pt").string() +
                                  ": the job stopped while saving"));
  }
}
