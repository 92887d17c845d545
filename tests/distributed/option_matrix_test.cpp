// The option audit: every option in every kind of pipe either takes effect (seen on a step's
// timeline, on the stages the pipe built, or in what it resolved) or is refused at construction
// with a text naming the fix. The kinds: the one-process Pipe over a Sequential, the Pipe over
// typed stages, PipeOver<T> over a transport of the tests' own (two ranks in one process),
// distributed::Pipe on 2 ranks, and the 2-D pipe (2 stages x 2 replicas on 4 ranks). kTable is
// docs/distributed.md's "Options in every pipe" table; tests/tools/option_table_test.py checks
// that the two agree.
#include "stagewise/distributed.hpp"
#include "stagewise/runtime/host_store.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"
#include "tests/support/wire_transport.hpp"

#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;
using namespace std::chrono_literals;

namespace {

enum Kind { kPipe, kTyped, kOver, kDistributed, kTwoD, kKinds };
const char* const kKindNames[kKinds] = {"Pipe", "Pipe<typed>", "PipeOver<T>", "distributed::Pipe",
                                        "2-D pipe"};

// yes: takes effect; refused: refused at construction; -: not an option of that kind of pipe.
constexpr const char* yes = "yes";
constexpr const char* refused = "refused";
constexpr const char* none = "-";

struct Row {
  const char* option;
  std::array<const char*, kKinds> outcome;  // Pipe, Pipe<typed>, PipeOver<T>, distributed, 2-D
};

// clang-format off
// option-table-begin
const Row kTable[] = {
    {"chunks",                        {yes, yes, yes, yes, yes}},
    {"checkpoint",                    {yes, yes, yes, yes, yes}},
    {"checkpoint per stage",          {yes, yes, yes, yes, yes}},
    {"devices",                       {yes, yes, yes, yes, yes}},
    {"deferred_batch_norm",           {yes, refused, yes, yes, refused}},
    {"offload",                       {yes, yes, yes, yes, yes}},
    {"optimizer_offload",             {yes, yes, yes, yes, yes}},
    {"memory_budget",                 {yes, refused, yes, yes, yes}},
    {"memory_budget with checkpoint", {refused, refused, refused, refused, refused}},
    {"schedule",                      {yes, yes, yes, yes, yes}},
    {"schedule places ranks",         {none, none, none, yes, yes}},
    {"virtual_stages",                {none, none, none, yes, yes}},
    {"placed_like",                   {none, none, none, yes, yes}},
    {"timeout",                       {none, none, none, yes, yes}},
    {"transport",                     {none, none, none, yes, yes}},
    {"backend",                       {none, none, none, yes, yes}},
    {"bucket_bytes",                  {none, none, none, none, yes}},
    {"unused_parameters",             {none, none, none, none, yes}},
    {"shard_optimizer_state",         {none, none, none, refused, yes}},
    {"reduce_scatter",                {none, none, none, none, yes}},
};
// option-table-end
// clang-format on

// What a kind of pipe ran: per stage of this process, the actions its step ran by kind; the
// pipe's resolved options; its DeferredBatchNorms' counts of committed mini-batches.
struct Observed {
  std::map<int, std::map<char, int>> actions;  // stage -> action kind -> count
  sw::ResolvedPipeOptions resolved;
  std::vector<std::int64_t> committed;  // num_batches_tracked of each DeferredBatchNorm
  std::vector<torch::Device> devices;   // of this process's parameters
  std::size_t state_offloaded = 0;      // the fused step's parameters whose state was offloaded
};

// One row's options for one kind, and what must be seen (or the refusal's text).
struct Probe {
  sw::PipeOptions options = sw::PipeOptions().chunks(4);
  sw::distributed::Options dist;
  sw::balance balance{3, 3};
  sched::any_schedule schedule{"gpipe", sched::gpipe{}};
  bool options_schedule = false;  // train_step given no schedule: the options' runs
  bool fused = false;             // train_step given a fused Adam step
  bool sharded = false;           // a distributed::Sharded optimizer built before the step
  std::string refusal;                                // when refused
  std::function<std::string(const Observed&)> check;  // "" when it took effect
};

torch::nn::Sequential model(int stages) {
  torch::manual_seed(11);
  if (stages == 2) {
    return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::BatchNorm1d(8),
                                 torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh(),
                                 torch::nn::Linear(8, 3));
  }
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); }

// Every stage of this process ran `kind` `want(stage)` times.
std::string count_is(const Observed& o, char kind, const std::function<int(int)>& want) {
  if (o.actions.empty()) return "no stage ran";
  for (const auto& [stage, counts] : o.actions) {
    const auto it = counts.find(kind);
    const int got = it == counts.end() ? 0 : it->second;
    if (got != want(stage)) {
      return "stage " + std::to_string(stage) + " ran " + std::to_string(got) + " " + kind +
             ", expected " + std::to_string(want(stage));
    }
  }
  return "";
}

std::string stages_are(const Observed& o, const std::set<int>& want) {
  std::set<int> got;
  for (const auto& [stage, counts] : o.actions) got.insert(stage);
  return got == want ? "" : "ran other stages than expected";
}

Probe probe(const std::string& option, Kind kind) {
  Probe p;
  const bool replicas = kind == kTwoD;
  if (option == "chunks") {
    p.options.chunks(2);
    p.check = [](const Observed& o) { return count_is(o, 'F', [](int) { return 2; }); };
  } else if (option == "checkpoint") {
    p.options.checkpoint(sw::Checkpoint::always);
    p.check = [](const Observed& o) { return count_is(o, 'R', [](int) { return 4; }); };
  } else if (option == "checkpoint per stage") {
    p.options.checkpoint({sw::Checkpoint::never, sw::Checkpoint::always});
    p.check = [](const Observed& o) {
      return count_is(o, 'R', [](int j) { return j == 0 ? 0 : 4; });
    };
  } else if (option == "devices") {
    p.options.devices({torch::kCPU, torch::kCPU});
    p.check = [](const Observed& o) {
      for (const auto& d : o.devices)
        if (!d.is_cpu()) return std::string("a parameter is on ") + d.str();
      return o.resolved.devices.size() == 2 ? std::string() : std::string("devices not resolved");
    };
  } else if (option == "deferred_batch_norm") {
    p.options.deferred_batch_norm(true);
    p.refusal = kind == kTyped ? "stagewise: deferred batch norm cannot reach the batch norm"
                               : "PipeOptions().deferred_batch_norm(true) with "
                                 "Options().data_parallel(2): each replica would keep running "
                                 "statistics of its own rows only";
    p.check = [](const Observed& o) {
      // The rank without the batch norm has none to commit.
      for (auto n : o.committed)
        if (n != 1) return "committed " + std::to_string(n) + " mini-batches, expected 1";
      return o.actions.count(0) && o.committed.empty() ? std::string("no DeferredBatchNorm")
                                                       : std::string();
    };
  } else if (option == "offload") {
    p.options.checkpoint(sw::Checkpoint::always)
        .offload(sw::runtime::HostStore(), sched::OffloadCosts{.round_trips = 0.0});
    p.check = [](const Observed& o) {
      for (const auto& [stage, counts] : o.actions) {
        const auto it = counts.find('O');
        const bool offloaded = it != counts.end() && it->second > 0;
        if (offloaded != (stage != 0)) return "stage " + std::to_string(stage) + " offloads wrong";
      }
      return std::string();
    };
  } else if (option == "optimizer_offload") {
    p.options.optimizer_offload(sw::runtime::HostStore(), 1.0);
    p.fused = true;
    p.check = [](const Observed& o) {
      if (o.state_offloaded != o.devices.size()) {
        return "the state of " + std::to_string(o.state_offloaded) + " of " +
               std::to_string(o.devices.size()) + " parameters went off the device";
      }
      return o.resolved.optimizer_shares.size() == 2 ? std::string()
                                                     : std::string("shares not resolved");
    };
  } else if (option == "memory_budget" || option == "memory_budget with checkpoint") {
    // A budget every plan fits: the fastest, checkpointing nothing (the default except_last
    // would recompute 3 of the 4 micro-batches on every stage).
    p.options.memory_budget(1LL << 30, torch::randn({replicas ? 2 : 4, 6}));
    if (option == "memory_budget with checkpoint") p.options.checkpoint(sw::Checkpoint::always);
    p.refusal = kind == kTyped || option == "memory_budget"
                    ? "memory_budget plans from the layers of a Sequential"
                    : "memory_budget chooses each stage's checkpoint mode, and checkpoint(...) "
                      "sets them too; drop checkpoint(...) to let the budget choose, or drop the "
                      "budget";
    p.check = [](const Observed& o) {
      if (!o.resolved.memory_plan) return std::string("no memory plan");
      return count_is(o, 'R', [](int) { return 0; });
    };
  } else if (option == "schedule") {
    p.options.schedule(sched::any_schedule(sched::zero_bubble_h1{}));
    p.options_schedule = true;
    p.check = [](const Observed& o) { return count_is(o, 'W', [](int) { return 4; }); };
  } else if (option == "schedule places ranks") {
    p.options.schedule(sched::any_schedule(sched::v_half{}));
    p.options_schedule = true;
    p.balance = {2, 1, 2, 1};
    p.check = [](const Observed& o) {
      const int r = o.actions.count(0) ? 0 : 1;
      const auto w = count_is(o, 'W', [](int) { return 4; });
      return w.empty() ? stages_are(o, r == 0 ? std::set<int>{0, 3} : std::set<int>{1, 2}) : w;
    };
  } else if (option == "virtual_stages") {
    p.dist.virtual_stages(2);
    p.balance = {2, 1, 2, 1};
    p.schedule = {"interleaved", sched::interleaved_one_f_one_b{2}};
    p.check = [](const Observed& o) { return count_is(o, 'F', [](int) { return 4; }); };
  } else if (option == "placed_like") {
    p.dist.placed_like(sched::zero_bubble_v{});
    p.balance = {2, 1, 2, 1};
    p.schedule = {"zero_bubble_v", sched::zero_bubble_v{}};
    p.check = [](const Observed& o) {
      const int r = o.actions.count(0) ? 0 : 1;
      return stages_are(o, r == 0 ? std::set<int>{0, 3} : std::set<int>{1, 2});
    };
  } else if (option == "timeout") {
    p.dist.timeout(20s);
    p.check = [](const Observed& o) { return count_is(o, 'F', [](int) { return 4; }); };
  } else if (option == "transport" || option == "backend") {
    if (option == "backend") p.dist.backend(sw::runtime::Backend::gloo);
    p.check = [](const Observed& o) { return count_is(o, 'F', [](int) { return 4; }); };
  } else if (option == "bucket_bytes" || option == "unused_parameters") {
    if (option == "bucket_bytes") p.dist.bucket_bytes(64);
    if (option == "unused_parameters") p.dist.unused_parameters(true);
    p.check = [](const Observed& o) { return count_is(o, 'B', [](int) { return 4; }); };
  } else if (option == "shard_optimizer_state" || option == "reduce_scatter") {
    p.dist.shard_optimizer_state(true);
    p.sharded = true;
    if (option == "reduce_scatter") p.dist.reduce_scatter(sw::runtime::ReduceScatter::all_to_all);
    p.refusal =
        "Options().shard_optimizer_state(true) shards each stage's optimizer state over "
        "its data-parallel replicas, but the pipe has one (data_parallel(1))";
    p.check = [](const Observed& o) { return count_is(o, 'B', [](int) { return 4; }); };
  }
  return p;
}

// What one pipe of this process ran in a step (`stages`: its stage modules, to find its
// DeferredBatchNorms; `timeline`: the step's).
template <class P>
Observed observe(P& pipe, const sched::Timeline& timeline) {
  Observed o;
  for (const auto& e : timeline.actions) {
    ++o.actions[e.action.stage][static_cast<char>(e.action.kind)];
  }
  o.resolved = pipe->resolved_options();
  for (const auto& m : pipe->modules()) {
    if (auto bn = std::dynamic_pointer_cast<sw::DeferredBatchNormImpl>(m)) {
      o.committed.push_back(bn->num_batches_tracked.template item<std::int64_t>());
    }
  }
  for (const auto& t : pipe->parameters()) o.devices.push_back(t.device());
  return o;
}

const torch::Tensor& input() {
  static const torch::Tensor x = (torch::manual_seed(5), torch::randn({16, 6}));
  return x;
}
const torch::Tensor& target() {
  static const torch::Tensor y = (torch::manual_seed(6), torch::randn({16, 3}));
  return y;
}

// One step of `pipe` with the probe's schedule, or, where the probe sets the options' schedule,
// with none (train_step then runs the options'); with the probe's fused step, how many of its
// parameters' state went off the device.
template <class P>
std::size_t step(P& pipe, const Probe& p, const torch::Tensor& x, const torch::Tensor& y,
                 sched::Timeline& t) {
  if (p.fused) {
    sw::optim::FusedStep fused(pipe->named_parameters(), torch::optim::AdamOptions(1e-3));
    pipe->train_step(x, y, mse, fused, p.schedule, &t);
    std::size_t held = 0;
    for (std::size_t i = 0; i < fused.size(); ++i) held += fused.offloaded(i);
    return held;
  }
  // A sharded pipe refuses a reduction that no optimizer will send on: build one (not stepped).
  std::optional<sw::distributed::Sharded<torch::optim::SGD>> sharded;
  if constexpr (requires { pipe->sharded_parameters(); }) {
    if (p.sharded) sharded.emplace(pipe, torch::optim::SGDOptions(0.1));
  }
  if (p.options_schedule) {
    pipe->train_step(x, y, mse, &t);
  } else {
    pipe->train_step(x, y, mse, p.schedule, &t);
  }
  return 0;
}

// The outcome of `p` in one process: "" when as expected, else what differs. `build` makes the
// pipe (throws when refused), `step(pipe, timeline)` runs one step.
template <class Build, class Step>
std::string outcome(const char* expected, const Probe& p, Build build, Step step) {
  if (std::string(expected) == refused) {
    const auto e = error_of([&] { (void)build(); });
    return contains(e, p.refusal) ? "" : "expected a refusal containing '" + p.refusal + "', got: " + e;
  }
  try {
    auto pipe = build();
    sched::Timeline timeline;
    const std::size_t held = step(pipe, timeline);
    auto observed = observe(pipe, timeline);
    observed.state_offloaded = held;
    return p.check(observed);
  } catch (const std::exception& e) {
    return std::string("failed: ") + e.what();
  }
}

std::string run_pipe(const char* expected, const Probe& p) {
  return outcome(
      expected, p, [&] { return sw::Pipe(model(2), p.balance, p.options); },
      [&](auto& pipe, sched::Timeline& t) { return step(pipe, p, input(), target(), t); });
}

std::string run_typed(const char* expected, const Probe& p) {
  auto seq = model(2);
  torch::nn::Sequential first, second;
  for (std::size_t k = 0; k < 6; ++k) {
    (k < 3 ? first : second)->push_back(*(seq->begin() + static_cast<std::ptrdiff_t>(k)));
  }
  return outcome(
      expected, p, [&] { return sw::Pipe(sw::stages(first, second), p.options); },
      [&](auto& pipe, sched::Timeline& t) { return step(pipe, p, input(), target(), t); });
}

// Two ranks over the tests' wire, on two threads (each with options of its own: a store is not
// shared); the outcome of either that differs.
std::string run_over(const char* expected, const std::string& option) {
  using sw::testing::Wire;
  using sw::testing::WireEnd;
  using sw::testing::WirePipe;
  auto seq = model(2);
  auto wire = std::make_shared<Wire>();
  std::array<std::string, 2> got;
  auto rank = [&](int r) {
    const Probe p = probe(option, kOver);
    got[static_cast<std::size_t>(r)] = outcome(
        expected, p,
        [&] { return WirePipe(seq, p.balance, p.options, std::make_unique<WireEnd>(wire, r)); },
        [&](auto& pipe, sched::Timeline& t) {
          return step(pipe, p, r == 0 ? input() : torch::Tensor(),
                      r == 1 ? target() : torch::Tensor(), t);
        });
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  return got[0].empty() ? got[1] : "rank 0: " + got[0];
}

// The distributed kinds, inside a rank: every row, each pipe with its own store prefix; returns
// the rows whose outcome differs.
std::string run_ranked(Kind kind, int rank) {
  auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
  std::string failures;
  int n = 0;
  for (const auto& row : kTable) {
    const char* expected = row.outcome[kind];
    if (std::string(expected) == none) continue;
    Probe p = probe(row.option, kind);
    const int d = kind == kTwoD ? 2 : 1;
    p.dist.data_parallel(d).transport(
        sw::runtime::C10dOptions().prefix("m" + std::to_string(n++)));
    const auto got = outcome(
        expected, p,
        [&] {
          return sw::distributed::Pipe(c, model(static_cast<int>(p.balance.size())), p.balance,
                                       p.options, p.dist);
        },
        [&](auto& pipe, sched::Timeline& t) {
          const int stages = pipe->num_stages();
          const auto x = pipe->shard(input()), y = pipe->shard(target());
          return step(pipe, p, pipe->has_stage(0) ? x : torch::Tensor(),
                      pipe->has_stage(stages - 1) ? y : torch::Tensor(), t);
        });
    if (!got.empty()) failures += std::string(row.option) + " on rank " + std::to_string(rank) + ": " + got + "\n";
  }
  return failures;
}

void check_ranks(Kind kind, int world) {
  const auto r = sw::testing::run_ranks(
      world,
      [kind](int rank) {
        const auto failures = run_ranked(kind, rank);
        TORCH_CHECK(failures.empty(), failures);
      },
      180s);
  for (int k = 0; k < world; ++k) {
    CAPTURE(k);
    CHECK(r[static_cast<std::size_t>(k)].text == "");
    CHECK(r[static_cast<std::size_t>(k)].status == 0);
  }
}

// Runs `body` in a child process (its failure: an exception, as TORCH_CHECK throws), checking
// here that it passed.
void in_child(const std::function<void()>& body) {
  const auto r = sw::testing::run_ranks(1, [&](int) { body(); }, 180s);
  CHECK(r[0].text == "");
  CHECK(r[0].status == 0);
}

void expect(bool ok, const char* what) { TORCH_CHECK(ok, what); }

}  // namespace

TEST_SUITE("every option in every pipe") {
  // Each case whose pipes train in this process runs them in a child (in_child): LibTorch 2.6's
  // autograd refuses to run in a process forked after this one trained one-process pipes
  // ("Unable to handle autograd's threading in combination with fork-based multiprocessing"),
  // and the tests after these in the binary fork their ranks.
  TEST_CASE("one process: Pipe over a Sequential, over typed stages, and PipeOver<T>") {
    in_child([] {
      std::string failures;
      for (const auto& row : kTable) {
        for (Kind kind : {kPipe, kTyped, kOver}) {
          const char* expected = row.outcome[kind];
          if (std::string(expected) == none) continue;
          const std::string got = kind == kPipe    ? run_pipe(expected, probe(row.option, kind))
                                  : kind == kTyped ? run_typed(expected, probe(row.option, kind))
                                                   : run_over(expected, row.option);
          if (!got.empty())
            failures += std::string(row.option) + " in " + kKindNames[kind] + ": " + got + "\n";
        }
      }
      TORCH_CHECK(failures.empty(), failures);
    });
  }

  TEST_CASE("distributed::Pipe on 2 ranks") { check_ranks(kDistributed, 2); }

  TEST_CASE("the 2-D pipe: 2 stages x 2 replicas on 4 ranks") { check_ranks(kTwoD, 4); }

  TEST_CASE("setters do not depend on their order: the budget reads offload's costs when built") {
    in_child([] {
      const auto sample = torch::randn({4, 6});
      const sched::OffloadCosts costs{.round_trips = 0.0};
      auto a = sw::Pipe(model(2), sw::balance{3, 3},
                        sw::PipeOptions().chunks(4).memory_budget(1LL << 30, sample).offload(
                            sw::runtime::HostStore(), costs));
      auto b = sw::Pipe(model(2), sw::balance{3, 3},
                        sw::PipeOptions().chunks(4).offload(sw::runtime::HostStore(), costs)
                            .memory_budget(1LL << 30, sample));
      expect(a->resolved_options().offload_costs == b->resolved_options().offload_costs,
             "the offload costs differ with the setters' order");
      expect(a->resolved_options().offload_costs.round_trips == 0.0, "round_trips is not the given 0");
      expect(a->resolved_options().checkpoints == b->resolved_options().checkpoints,
             "the checkpoints differ with the setters' order");
      // The user's options are left as given.
      expect(!a->options().checkpoint_given(), "the budget wrote the user's checkpoint option");
      expect(contains(error_of([&] {
                       (void)sw::Pipe(model(2), sw::balance{3, 3},
                                      sw::PipeOptions()
                                          .offload(sw::runtime::HostStore())
                                          .memory_budget(1LL << 30, sample, sw::runtime::HostStore()));
                     }),
                     "stagewise::Pipe: memory_budget(bytes, sample, store) and offload(store) both "
                     "give a store; give it once"),
             "two stores are not refused by their text");
    });
  }
}
