// Resume on other ranks: a save made under one plan (its split, ranks, replicas, one process or
// many, fused or unfused step, with a GradScaler) loads under another, and the job goes on as a
// job of that plan started from the same state would: bit for bit where the arithmetic is the
// same (another split or number of ranks of one pipeline, one process or many, fused or not:
// every layer computes alike and every stage accumulates its micro-batches in the schedule's
// order), within 1e-6 relative where it is not (replicas average their mean gradients, where one
// pipeline accumulates its micro-batches' over all the rows).

#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace sw = stagewise;
namespace fs = std::filesystem;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

constexpr int kSteps = 4;

torch::nn::Sequential model(std::uint64_t seed) {
  torch::manual_seed(seed);
  using namespace torch::nn;
  return Sequential(Linear(6, 8), Tanh(), Linear(8, 8), Tanh(), Linear(8, 8), Tanh(), Linear(8, 8),
                    Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

// Step s's global batch: every rank draws it alike.
std::pair<torch::Tensor, torch::Tensor> batch(int s) {
  torch::manual_seed(700 + s);
  return {torch::randn({8, 6}), torch::randn({8, 3})};
}

fs::path scratch(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  auto dir = fs::path(tmp ? tmp : fs::temp_directory_path().string()) /
             ("resume_plans_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  return dir;
}

// A job: its plan (split, replicas; one process or ranks; fused Adam or not), the steps it runs,
// where it saves (after step `save_at`) and loads from, and where each process writes its
// parameters when done.
struct Job {
  sw::balance split = {};
  int replicas = 1;
  bool fused = false;
  bool one_process = false;
  int from = 0, to = kSteps, save_at = -1;
  fs::path save = {}, load = {}, out = {};
  bool load_own_copy = false;  // each rank loads load/rank<r>: its machine's copy of the save
  bool v = false;              // ZB-V (two stages per rank, in a V) instead of 1F1B
  int planned = 0;             // > 0: plan_pipeline's plan for that many ranks (split unused)
};

// Writes this process's parameters under the model's names ("stage<j>." dropped) to `out`.
void write_parameters(torch::nn::Module& pipe, const fs::path& out, int rank) {
  torch::serialize::OutputArchive a;
  std::int64_t n = 0;
  for (const auto& p : pipe.named_parameters()) {
    a.write("name" + std::to_string(n), c10::IValue(p.key().substr(p.key().find('.') + 1)));
    a.write("tensor" + std::to_string(n++), p.value().detach(), /*is_buffer=*/true);
  }
  a.write("count", c10::IValue(n));
  fs::create_directories(out);
  a.save_to((out / ("rank" + std::to_string(rank) + ".pt")).string());
}

// Every process's parameters of a job, by name (replicas must agree bit for bit).
std::map<std::string, torch::Tensor> parameters_of(const fs::path& out) {
  std::map<std::string, torch::Tensor> all;
  for (const auto& f : fs::directory_iterator(out)) {
    torch::serialize::InputArchive a;
    a.load_from(f.path().string());
    c10::IValue v;
    a.read("count", v);
    for (std::int64_t i = 0; i < v.toInt(); ++i) {
      c10::IValue name;
      torch::Tensor t;
      a.read("name" + std::to_string(i), name);
      a.read("tensor" + std::to_string(i), t, /*is_buffer=*/true);
      auto [it, fresh] = all.emplace(name.toStringRef(), t);
      if (!fresh) {
        INFO(name.toStringRef());
        CHECK(torch::equal(it->second, t));
      }
    }
  }
  return all;
}

// The training loop every job runs, on either kind of pipe.
template <class PipeHolder, class Shard>
void train(PipeHolder& pipe, const Job& job, bool first, bool last, const Shard& shard, int rank) {
  const auto load = job.load_own_copy ? job.load / ("rank" + std::to_string(rank)) : job.load;
  std::unique_ptr<torch::optim::Adam> adam;
  std::unique_ptr<sw::optim::FusedStep> fused;
  if (job.fused) {
    fused =
        std::make_unique<sw::optim::FusedStep>(pipe->parameters(), torch::optim::AdamOptions(1e-2));
  } else {
    adam =
        std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-2));
  }
  // A scale that grows every other step: the resumed job must go on from the saved one.
  sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().init_scale(256).growth_interval(2));
  if (!load.empty()) {
    const auto step = job.fused ? pipe->load(load.string(), *fused, scaler)
                                : pipe->load(load.string(), *adam, scaler);
    TORCH_CHECK(step == job.from - 1, "loaded step ", step);
  }
  for (int s = job.from; s < job.to; ++s) {
    auto [x, y] = batch(s);
    x = first ? shard(x) : torch::Tensor();
    y = last ? shard(y) : torch::Tensor();
    if (fused) {
      pipe->train_step(x, y, mse, *fused, scaler);  // the options' schedule
    } else {
      adam->zero_grad();
      pipe->train_step(x, y, mse, scaler);
      scaler.step(*adam);
    }
    scaler.update();
    if (s == job.save_at) {
      fused ? pipe->save(job.save.string(), *fused, scaler, s)
            : pipe->save(job.save.string(), *adam, scaler, s);
    }
  }
  // No step overflows, so the scale doubles after every second step since step 0: a resumed
  // job's too, if it went on from the saved scale and count.
  const double expected = 256.0 * static_cast<double>(1 << (job.to / 2));
  TORCH_CHECK(scaler.get_scale() == expected, "scale ", scaler.get_scale(), ", expected ",
              expected);
  write_parameters(*pipe, job.out, rank);
}

void run(const Job& job, int rank) {
  auto seq = model(job.load.empty() ? 1 : 2);  // a resumed job starts elsewhere: load replaces it
  auto options = sw::PipeOptions().chunks(4);
  if (job.v) {
    options.schedule(sw::schedule::any_schedule(sw::schedule::zero_bubble_v{}));  // on ranks too
  } else {
    options.schedule(sw::schedule::any_schedule(sw::schedule::one_f_one_b{}));
  }
  if (job.planned > 0) {
    // The plan for the ranks (stages x replicas chosen), by memory so that it is the same in
    // every run: the split by size, 1F1B, 4 micro-batches.
    const auto [x, y] = batch(0);
    const auto plan = sw::plan_pipeline(seq, sw::Batch(x), y, mse,
                                        sw::PlanOptions()
                                            .ranks(job.planned)
                                            .link(sw::LinkSpeed{})
                                            .memory_per_worker(64 << 20)
                                            .rounds(1)
                                            .micro_batches({4})
                                            .schedules({"one_f_one_b"})
                                            .fused_step(job.fused)
                                            .prefer(sw::PlanFor::memory));
    sw::distributed::Pipe pipe(seq, plan, sw::distributed::Options().timeout(30s));
    const int n = pipe->num_stages();
    train(
        pipe, job, pipe->has_stage(0), pipe->has_stage(n - 1),
        [&](const torch::Tensor& t) { return pipe->shard(t); }, rank);
    return;
  }
  if (job.one_process) {
    auto pipe = sw::Pipe<>(seq, job.split, options);
    train(
        pipe, job, true, true, [](const torch::Tensor& t) { return t; }, rank);
    return;
  }
  sw::distributed::Pipe pipe(seq, job.split, options,
                             sw::distributed::Options().data_parallel(job.replicas).timeout(30s));
  const int n = pipe->num_stages();
  train(
      pipe, job, pipe->has_stage(0), pipe->has_stage(n - 1),
      [&](const torch::Tensor& t) { return pipe->shard(t); }, rank);
}

// Runs `job` on `ranks` processes; every one must finish.
void launch(int ranks, const Job& job) {
  const auto r = run_ranks(
      ranks, [&](int rank) { run(job, rank); }, 180s);
  for (int k = 0; k < ranks; ++k) {
    INFO("rank " << k << ": " << r[static_cast<std::size_t>(k)].text);
    REQUIRE(r[static_cast<std::size_t>(k)].status == 0);
  }
}

// Equal names, and each parameter equal bit for bit (rel = 0) or within `rel` relative.
void expect_equal(const std::map<std::string, torch::Tensor>& a,
                  const std::map<std::string, torch::Tensor>& b, double rel = 0) {
  REQUIRE(a.size() == b.size());
  REQUIRE(a.size() == 10);  // the model's 5 weights and 5 biases
  for (const auto& [name, t] : a) {
    INFO(name);
    REQUIRE(b.count(name) == 1);
    if (rel == 0) {
      CHECK(torch::equal(t, b.at(name)));
    } else {
      const double diff = (t - b.at(name)).abs().max().item<double>();
      const double scale = t.abs().max().item<double>();
      CHECK(diff <= rel * scale);
    }
  }
}

}  // namespace

TEST_SUITE("resume on other ranks") {
  TEST_CASE("a plan_pipeline plan for 4 ranks, saved, resumed with the plan it makes for 2") {
    const auto root = scratch("planned");
    launch(4, {.save_at = 1, .save = root / "s4", .out = root / "o4", .planned = 4});
    const auto saved = sw::read_save_info((root / "s4").string());
    REQUIRE(saved.has_value());
    CHECK(saved->processes == 4);
    launch(2, {.out = root / "o2", .planned = 2});
    launch(2, {.from = 2, .load = root / "s4", .out = root / "r2", .planned = 2});
    // Within 1e-6: either plan may have replicas, which average where one pipeline accumulates.
    expect_equal(parameters_of(root / "o2"), parameters_of(root / "r2"), 1e-6);
  }

  TEST_CASE(
      "saved on 4 ranks, resumed on 2, and back: bit for bit as the job of that plan, "
      "fused or not, with the scaler") {
    const auto root = scratch("ranks");
    const sw::balance four{2, 2, 2, 2}, two{4, 4};
    // The 4-rank job (unfused) and the 2-rank job (fused), each saving after step 1.
    launch(4, {.split = four, .save_at = 1, .save = root / "s4", .out = root / "o4"});
    launch(2, {.split = two, .fused = true, .save_at = 1, .save = root / "s2", .out = root / "o2"});
    // The two plans train alike: the 2-rank job from the 4-rank job's state is the 2-rank job.
    expect_equal(parameters_of(root / "o4"), parameters_of(root / "o2"));
    launch(2, {.split = two, .fused = true, .from = 2, .load = root / "s4", .out = root / "r2"});
    expect_equal(parameters_of(root / "r2"), parameters_of(root / "o2"));
    launch(4, {.split = four, .from = 2, .load = root / "s2", .out = root / "r4"});
    expect_equal(parameters_of(root / "r4"), parameters_of(root / "o4"));
  }

  TEST_CASE(
      "saved on 2 stages x 2 replicas, or by a V of 4 stages on 2 ranks, resumed on 4 "
      "stages x 1: within 1e-6 of the 4-rank job") {
    const auto root = scratch("replicas");
    const sw::balance four{2, 2, 2, 2};
    launch(4, {.split = four, .out = root / "o4"});
    launch(4, {.split = {4, 4},
               .replicas = 2,
               .to = 2,
               .save_at = 1,
               .save = root / "s22",
               .out = root / "o22"});
    launch(4, {.split = four, .from = 2, .load = root / "s22", .out = root / "r22"});
    // Replicas average their mean gradients where one pipeline accumulates its micro-batches'
    // over all the rows: the same sum in another order, about 1e-7 apart.
    expect_equal(parameters_of(root / "r22"), parameters_of(root / "o4"), 1e-6);
    // ZB-V: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2, each backward split in two, with
    // the fused step (which the unfused 4-rank job loads); another schedule, another order.
    launch(2, {.split = four,
               .fused = true,
               .to = 2,
               .save_at = 1,
               .save = root / "sv",
               .out = root / "ov",
               .v = true});
    launch(4, {.split = four, .from = 2, .load = root / "sv", .out = root / "rv"});
    expect_equal(parameters_of(root / "rv"), parameters_of(root / "o4"), 1e-6);
  }

  TEST_CASE(
      "one process to 2 ranks and back to one process (another split each time): bit for "
      "bit") {
    const auto root = scratch("processes");
    launch(1, {.split = {4, 4},
               .one_process = true,
               .save_at = 1,
               .save = root / "s1",
               .out = root / "o1"});
    launch(2, {.split = {2, 6},
               .fused = true,
               .from = 2,
               .to = 3,
               .save_at = 2,
               .save = root / "s2",
               .load = root / "s1",
               .out = root / "o2"});
    launch(
        1,
        {.split = {8}, .one_process = true, .from = 3, .load = root / "s2", .out = root / "o1b"});
    expect_equal(parameters_of(root / "o1b"), parameters_of(root / "o1"));
  }

  TEST_CASE(
      "each rank reads only the files its stages need: a copy of its own files per machine "
      "loads under the plan that saved it; another plan names the file a rank lacks") {
    const auto root = scratch("own_files");
    launch(2, {.split = {4, 4}, .to = 2, .save_at = 1, .save = root / "whole", .out = root / "o"});
    for (const int r : {0, 1}) {  // each machine's disk: the index, its stage's and its own files
      const auto mine = root / "copies" / ("rank" + std::to_string(r));
      fs::create_directories(mine);
      for (const auto& name :
           {std::string("index.pt"), "stage" + std::to_string(r) + ".pt",
            "stage" + std::to_string(r) + ".optimizer.pt", "rank" + std::to_string(r) + ".pt"}) {
        fs::copy(root / "whole" / name, mine / name);
      }
    }
    launch(2, {.split = {4, 4},
               .from = 2,
               .to = 2,
               .load = root / "copies",
               .out = root / "r",
               .load_own_copy = true});
    expect_equal(parameters_of(root / "r"), parameters_of(root / "o"));
    // Under {2, 6}, rank 1 runs layers 2 and 3 of the saved stage 0, whose file it lacks.
    const Job other{.split = {2, 6},
                    .from = 2,
                    .to = 2,
                    .load = root / "copies",
                    .out = root / "x",
                    .load_own_copy = true};
    const auto r = run_ranks(
        2, [&](int rank) { run(other, rank); }, 180s);
    const auto lacking = (root / "copies" / "rank1").string();
    const std::string cause = lacking + " has no " + lacking +
                              "/stage0.pt (parameters and buffers of its stage 0): the save is "
                              "incomplete, or not all its files are here";
    INFO(r[0].text);
    INFO(r[1].text);
    CHECK(r[0].status == 1);
    CHECK(r[1].status == 1);
    CHECK(sw::testing::contains(r[1].text, "stagewise::distributed::Pipe::load: " + cause));
    CHECK(sw::testing::contains(r[0].text,
                                "stagewise::distributed::Pipe::load: rank 1 failed: " + cause));
  }
}
