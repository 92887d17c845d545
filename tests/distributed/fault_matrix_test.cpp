// The fault matrix of issue #25: one rank of three fails (killed by SIGKILL, or throwing a
// c10::Error or a std::runtime_error) in a forward, a backward, a recompute or the fused optimizer
// step, on the first, middle or last rank, under GPipe, 1F1B, ZB-H1 and interleaved 1F1B: the full
// product, 144 jobs of 3 processes (about 0.6 s each), one TEST_CASE per schedule.
//
// For every job: no rank times out, and every rank that was not killed ends its step, and its
// pipe, within Options().timeout (5 s) of the step's start, so none waited for the timeout to
// learn of the failure; the failing rank's error is its own exception, with its cell; every
// survivor's error names the failing rank, and for a thrown error its text and cell, in the same
// text on every survivor; no rank returned from train_step (so none can run an unfused optimizer
// step the others do not); every child is reaped. Loopback only; each job is bounded by
// run_ranks' deadline (3 x the timeout).
//
// The fused optimizer step is not atomic across ranks: survivors whose stages finished their
// backward before the failure have stepped (counted, not asserted); no rank goes on after a
// failed step, and every rank is put back alike by resuming from the last save
// (resume_test.cpp, docs/distributed.md).

#include "stagewise/distributed.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <errno.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <regex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

enum class Schedule { gpipe, one_f_one_b, zb_h1, interleaved };
enum class Position { first, middle, last };
enum class Fault { sigkill, c10_error, std_error };
enum class Where { forward, backward, recompute, optimizer };

constexpr std::array kPositions{Position::first, Position::middle, Position::last};
constexpr std::array kFaults{Fault::sigkill, Fault::c10_error, Fault::std_error};
constexpr std::array kWheres{Where::forward, Where::backward, Where::recompute, Where::optimizer};

constexpr int kRanks = 3;
constexpr int kMicroBatches = 3;  // a multiple of the ranks: interleaved runs without extra bubble
constexpr std::chrono::milliseconds kTimeout = 5s;  // distributed::Options().timeout

const char* name(Schedule s) {
  switch (s) {
    case Schedule::gpipe:
      return "GPipe";
    case Schedule::one_f_one_b:
      return "1F1B";
    case Schedule::zb_h1:
      return "ZB-H1";
    case Schedule::interleaved:
      return "interleaved";
  }
  return "?";
}
const char* name(Position p) {
  switch (p) {
    case Position::first:
      return "first rank";
    case Position::middle:
      return "middle rank";
    case Position::last:
      return "last rank";
  }
  return "?";
}
const char* name(Fault f) {
  switch (f) {
    case Fault::sigkill:
      return "SIGKILL";
    case Fault::c10_error:
      return "c10::Error";
    case Fault::std_error:
      return "std::runtime_error";
  }
  return "?";
}
const char* name(Where w) {
  switch (w) {
    case Where::forward:
      return "forward";
    case Where::backward:
      return "backward";
    case Where::recompute:
      return "recompute";
    case Where::optimizer:
      return "optimizer step";
  }
  return "?";
}

// One job: `fault` in `where` on the rank at `position`, under `schedule`, the `at`-th time the
// failing stage enters that phase (for the optimizer step: at the first parameter to step).
struct Job {
  Schedule schedule = Schedule::gpipe;
  Position position = Position::first;
  Fault fault = Fault::sigkill;
  Where where = Where::forward;
  int at = 0;

  std::string describe() const {
    return std::string(name(fault)) + " in " + name(where) + " on the " + name(position) +
           " under " + name(schedule) +
           (where == Where::optimizer ? "" : " (call " + std::to_string(at) + ")");
  }
  int stages() const { return schedule == Schedule::interleaved ? 2 * kRanks : kRanks; }
  // The stage that fails: stage 0, stage 1, or the last stage (interleaved: rank 2's second
  // stage, which computes the loss).
  int stage() const {
    return position == Position::first ? 0 : position == Position::middle ? 1 : stages() - 1;
  }
  int rank() const { return stage() % kRanks; }
};

// --- Inside a rank ----------------------------------------------------------------------------

Job job_here;  // set in each rank before its pipe is built

[[noreturn]] void spring(const char* where) {
  switch (job_here.fault) {
    case Fault::sigkill:
      ::raise(SIGKILL);
      break;
    case Fault::c10_error:
      TORCH_CHECK(false, "fault injected in ", where);
    case Fault::std_error:
      throw std::runtime_error(std::string("fault injected in ") + where);
  }
  std::abort();  // not reached: SIGKILL cannot be caught
}

// Identity whose backward springs the fault at its `at`-th call.
struct BackwardTrap : torch::autograd::Function<BackwardTrap> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    static int calls = 0;
    if (calls++ == job_here.at) spring("backward");
    return g;
  }
};

// An identity layer in every stage. The failing stage's springs the fault at its `at`-th forward
// (the checkpointed first run: is_recomputing() false) or recompute (is_recomputing() true), or
// routes its input through BackwardTrap. A stage's forwards run in micro-batch order and its
// recomputes and backwards in its schedule's order, so the `at`-th is a known cell.
struct TrapImpl : torch::nn::Module {
  explicit TrapImpl(int stage) : stage(stage) {}
  torch::Tensor forward(torch::Tensor x) {
    if (stage != job_here.stage()) return x;
    if (sw::is_recomputing()) {
      if (job_here.where == Where::recompute && recomputes++ == job_here.at) spring("recompute");
    } else if (job_here.where == Where::forward && forwards++ == job_here.at) {
      spring("forward");
    }
    return job_here.where == Where::backward ? BackwardTrap::apply(x) : x;
  }
  int stage;
  int forwards = 0;
  int recomputes = 0;
};
TORCH_MODULE(Trap);

// SGD whose step springs the fault: FusedStep steps each parameter from its gradient hook, inside
// the backward that delivers the parameter's last gradient of the step.
struct TrapSGD : torch::optim::SGD {
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override {
    spring("optimizer step");
    return torch::optim::SGD::step(std::move(closure));
  }
};

// Stage j: Linear, Trap(j), Tanh.
torch::nn::Sequential model(int stages) {
  torch::manual_seed(7);
  torch::nn::Sequential s;
  for (int j = 0; j < stages; ++j) {
    s->push_back(torch::nn::Linear(4, 4));
    s->push_back(Trap(j));
    s->push_back(torch::nn::Tanh());
  }
  return s;
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

template <class S>
void train_step(sw::distributed::Pipe& pipe, const torch::Tensor& x, const torch::Tensor& y,
                const S& s, sw::optim::FusedStep* fused) {
  if (fused) {
    pipe->train_step(x, y, mse, *fused, s);
  } else {
    pipe->train_step(x, y, mse, s);
  }
}

// One rank of a job: one step with checkpoint "always" (every cell has a recompute); the optimizer
// job uses the fused step (TrapSGD on the failing rank, SGD elsewhere), the others the unfused
// train_step. Reports "<returned> <stepped> <ms>|<cell>|<error>": whether train_step returned,
// whether any of this rank's parameters changed, the milliseconds from the step's start until the
// pipe was gone, the cell error_context gives for its exception ("" if none) and its text.
void run_rank(const Job& job, int rank) {
  job_here = job;
  const int n = job.stages();
  auto dist = sw::distributed::Options().timeout(kTimeout);
  if (job.schedule == Schedule::interleaved) dist.virtual_stages(2);
  auto pipe = std::make_unique<sw::distributed::Pipe>(
      model(n), sw::balance(static_cast<std::size_t>(n), 3),
      sw::PipeOptions().chunks(kMicroBatches).checkpoint("always"), dist);
  std::unique_ptr<sw::optim::FusedStep> fused;
  if (job.where == Where::optimizer) {
    const bool trap = rank == job.rank();
    sw::optim::OptimizerFactory factory =
        [trap](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
      if (trap) return std::make_unique<TrapSGD>(std::move(p), torch::optim::SGDOptions(0.1));
      return std::make_unique<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(0.1));
    };
    fused = std::make_unique<sw::optim::FusedStep>((*pipe)->parameters(), factory);
  }
  std::vector<torch::Tensor> before;
  for (const auto& p : (*pipe)->parameters()) before.push_back(p.detach().clone());
  torch::manual_seed(1);
  const auto x = torch::randn({2 * kMicroBatches, 4});
  const auto y = torch::randn({2 * kMicroBatches, 4});

  bool returned = false;
  std::string error = "(no error)";
  std::string cell;
  const auto start = std::chrono::steady_clock::now();
  try {
    switch (job.schedule) {
      case Schedule::gpipe:
        train_step(*pipe, x, y, sched::gpipe{}, fused.get());
        break;
      case Schedule::one_f_one_b:
        train_step(*pipe, x, y, sched::one_f_one_b{}, fused.get());
        break;
      case Schedule::zb_h1:
        train_step(*pipe, x, y, sched::zero_bubble_h1{}, fused.get());
        break;
      case Schedule::interleaved:
        train_step(*pipe, x, y, sched::interleaved_one_f_one_b{2}, fused.get());
        break;
    }
    returned = true;
  } catch (const std::exception& e) {
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    error = c10 ? c10->what_without_backtrace() : e.what();
    if (auto where = sw::error_context(std::current_exception())) cell = where->text();
  }
  bool stepped = false;
  const auto params = (*pipe)->parameters();
  for (std::size_t k = 0; k < params.size(); ++k) {
    stepped = stepped || !torch::equal(params[k], before[k]);
  }
  fused.reset();
  pipe.reset();  // the transport's teardown (rank 0's wait for the others' acknowledgement) counts
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  report(std::to_string(returned) + " " + std::to_string(stepped) + " " + std::to_string(ms) + "|" +
         cell + "|" + error);
}

// --- In the test process (no thread is started here: run_ranks forks) ------------------------

struct Seen {
  bool returned = false;
  bool stepped = false;
  long ms = -1;
  std::string cell;
  std::string error;
};

Seen parse(const std::string& text) {
  Seen s;
  const auto bar = text.find('|');
  const auto bar2 = bar == std::string::npos ? bar : text.find('|', bar + 1);
  if (bar2 == std::string::npos) {
    s.error = text;  // the rank did not get as far as reporting: its exception, from run_ranks
    return s;
  }
  int returned = 0;
  int stepped = 0;
  if (std::sscanf(text.c_str(), "%d %d %ld", &returned, &stepped, &s.ms) != 3) s.ms = -1;
  s.returned = returned != 0;
  s.stepped = stepped != 0;
  s.cell = text.substr(bar + 1, bar2 - bar - 1);
  s.error = text.substr(bar2 + 1);
  return s;
}

sched::Plan plan_of(Schedule s) {
  const int n = s == Schedule::interleaved ? 2 * kRanks : kRanks;
  switch (s) {
    case Schedule::gpipe:
      return sched::plan(sched::gpipe{}, n, kMicroBatches, kMicroBatches);
    case Schedule::one_f_one_b:
      return sched::plan(sched::one_f_one_b{}, n, kMicroBatches, kMicroBatches);
    case Schedule::zb_h1:
      return sched::plan(sched::zero_bubble_h1{}, n, kMicroBatches, kMicroBatches);
    case Schedule::interleaved:
      return sched::plan(sched::interleaved_one_f_one_b{2}, n, kMicroBatches, kMicroBatches);
  }
  return {};
}

std::string context_text(const sched::Action& a) {
  using K = sched::ActionKind;
  sw::ErrorContext c{a.stage, a.micro, sw::Phase::forward};
  switch (a.kind) {
    case K::forward:
      c.phase = sw::Phase::forward;
      break;
    case K::recompute:
      c.phase = sw::Phase::recompute;
      break;
    case K::backward:
      c.phase = sw::Phase::backward;
      break;
    case K::input_grad:
      c.phase = sw::Phase::input_grad;
      break;
    case K::weight_grad:
      c.phase = sw::Phase::weight_grad;
      break;
    case K::offload:
      c.phase = sw::Phase::offload;
      break;
    case K::reload:
      c.phase = sw::Phase::reload;
      break;
  }
  return c.text();
}

// The cell the failing rank's error must name ("stagewise: stage S, micro-batch M, PHASE"), read
// off the schedule's plan (checkpoint "always": every cell has its R):
// - forward / recompute: the job's `at`-th F / R of the failing stage;
// - backward: its `at`-th B; under ZB-H1 its `at`-th I, except on stage 0, whose input needs no
//   gradient: there the whole backward runs in W (runtime/split_backward.hpp);
// - optimizer step: the first action, in the failing rank's program order, that delivers one of
//   its stages' last gradient of the step (that stage's m-th B, or m-th W under ZB-H1).
std::string expected_cell(const Job& job) {
  using K = sched::ActionKind;
  const auto p = plan_of(job.schedule);
  const auto& program = p.programs[static_cast<std::size_t>(p.worker_of(job.stage()))];
  if (job.where == Where::optimizer) {
    std::vector<int> delivered(static_cast<std::size_t>(p.stages), 0);
    for (const auto& a : program) {
      if (a.kind != K::backward && a.kind != K::weight_grad) continue;
      if (++delivered[static_cast<std::size_t>(a.stage)] == kMicroBatches) return context_text(a);
    }
    return "(none)";
  }
  K kind = job.where == Where::forward ? K::forward : K::recompute;
  if (job.where == Where::backward) {
    kind = job.schedule != Schedule::zb_h1 ? K::backward
           : job.stage() == 0              ? K::weight_grad
                                           : K::input_grad;
  }
  int seen = 0;
  for (const auto& a : program) {
    if (a.stage == job.stage() && a.kind == kind && seen++ == job.at) return context_text(a);
  }
  return "(none)";
}

// The library's failure texts today (runtime/c10d/transport.hpp, detail/failure_watch.hpp).
std::string failed_text(int failing, const std::string& what, int rank) {
  return "stagewise: rank " + std::to_string(failing) + " failed: " + what + ". Rank " +
         std::to_string(rank) + " stops too.";
}
// A rank whose connection to `dead` closed: "exchanged <message> with it" (a receive, or a send
// that could not be posted) or "sent it <message>" (a send that could not complete).
std::regex gone_text(int dead, const std::string& observer, int rank) {
  return std::regex("stagewise: rank " + std::to_string(dead) +
                    " is gone: its connection closed while rank " + observer +
                    " (exchanged .+ with it|sent it .+); it crashed, was killed, or exited early "
                    "\\(see its output\\)\\. Transport error: .+\\. Rank " +
                    std::to_string(rank) + " stops too\\.");
}
// A survivor that lost both the store (rank 0's) and rank `other`'s connection.
std::string store_gone_text(int other, int rank) {
  return "stagewise: rank 0, which serves the job's store, is gone: the store stopped answering "
         "and rank " +
         std::to_string(other) + "'s connection closed while rank " + std::to_string(rank) +
         " waited; rank 0 crashed, was killed, or exited early (see its output), and rank " +
         std::to_string(other) + " stopped after it. Rank " + std::to_string(rank) + " stops too.";
}

struct Tally {
  int jobs = 0;
  long job_ms_total = 0;
  long job_ms_max = 0;
  long rank_ms_max = 0;
  int survivors_stepped = 0;  // fused optimizer jobs: survivors that stepped before the failure
};

// Runs one job and checks what every rank saw.
void check(const Job& job, Tally& tally) {
  INFO(job.describe());
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_ranks(
      kRanks, [&](int rank) { run_rank(job, rank); }, 3 * kTimeout);
  const long wall =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  ++tally.jobs;
  tally.job_ms_total += wall;
  tally.job_ms_max = std::max(tally.job_ms_max, wall);
  // Every child reaped: this process has none left.
  errno = 0;
  CHECK(::waitpid(-1, nullptr, WNOHANG) == -1);
  CHECK(errno == ECHILD);

  const int failing = job.rank();
  const std::string what = std::string("fault injected in ") + name(job.where);
  const std::string cell = expected_cell(job);
  const std::string with_cell = what + " (" + cell + ")";
  std::vector<std::string> survivor_texts;
  for (int rank = 0; rank < kRanks; ++rank) {
    const auto& o = r[static_cast<std::size_t>(rank)];
    const Seen s = parse(o.text);
    INFO("rank " << rank << ": status " << o.status << ", " << s.ms << " ms, cell '" << s.cell
                 << "', report: " << o.text);
    CHECK_FALSE(o.timed_out);
    if (rank == failing && job.fault == Fault::sigkill) {
      CHECK(o.status == -SIGKILL);
      continue;
    }
    CHECK(o.status == 0);
    CHECK_FALSE(s.returned);
    CHECK(s.ms >= 0);
    CHECK(s.ms < kTimeout.count());
    tally.rank_ms_max = std::max(tally.rank_ms_max, s.ms);
    if (job.where != Where::optimizer) CHECK_FALSE(s.stepped);
    if (rank == failing) {
      CHECK_FALSE(s.stepped);
      // Its own exception, with its cell (in the text of a c10::Error only).
      const std::string own = job.fault == Fault::c10_error ? with_cell : what;
      CHECK(s.error == own);
      CHECK(s.cell == cell);
      continue;
    }
    if (s.stepped) ++tally.survivors_stepped;
    // A survivor reports the failure as relayed, without a cell of its own.
    const std::string& text = s.error;
    CHECK(s.cell.empty());
    if (job.fault != Fault::sigkill) {
      CHECK(text == failed_text(failing, with_cell, rank));
      continue;
    }
    // Killed: the ranks that talked to it see the connection close and publish that through the
    // store; the others read it there. With rank 0 (the store) gone, each survivor says what it
    // saw itself: rank 0's connection closing, or the store gone with the other survivor's
    // connection (which stopped after rank 0).
    const std::string observer = failing == 0 ? std::to_string(rank) : "[0-9]";
    if (failing == 0) {
      CHECK((std::regex_match(text, gone_text(0, observer, rank)) ||
             text == store_gone_text(3 - rank, rank)));
    } else {
      CHECK(std::regex_match(text, gone_text(failing, observer, rank)));
      survivor_texts.push_back(text.substr(0, text.rfind(". Rank ")));
    }
  }
  // With the store alive, every survivor reads the same failure there.
  if (survivor_texts.size() == 2) CHECK(survivor_texts[0] == survivor_texts[1]);
}

// Every position x fault x phase under `s`; the call at which the fault springs cycles through
// the micro-batches.
void run_matrix(Schedule s) {
  Tally tally;
  int k = 0;
  for (auto position : kPositions) {
    for (auto fault : kFaults) {
      for (auto where : kWheres) check({s, position, fault, where, k++ % kMicroBatches}, tally);
    }
  }
  CHECK(tally.jobs == 36);
  MESSAGE(std::string(name(s)) << ": " << tally.jobs << " jobs in " << tally.job_ms_total
                               << " ms (slowest job " << tally.job_ms_max << " ms; slowest rank "
                               << tally.rank_ms_max << " ms from step start to pipe gone, bound "
                               << kTimeout.count()
                               << " ms); fused step: " << tally.survivors_stepped
                               << " survivors had stepped before the failure");
}

}  // namespace

TEST_SUITE("distributed fault matrix") {
  TEST_CASE("a fault anywhere under GPipe ends every rank in time, naming rank, cell and phase") {
    run_matrix(Schedule::gpipe);
  }
  TEST_CASE("a fault anywhere under 1F1B ends every rank in time, naming rank, cell and phase") {
    run_matrix(Schedule::one_f_one_b);
  }
  TEST_CASE("a fault anywhere under ZB-H1 ends every rank in time, naming rank, cell and phase") {
    run_matrix(Schedule::zb_h1);
  }
  TEST_CASE("a fault anywhere under interleaved 1F1B ends every rank in time, naming the cell") {
    run_matrix(Schedule::interleaved);
  }
}
