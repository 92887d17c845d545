// PyTorch's schedule CSV (torch.distributed.pipelining, "compute_only"): from_csv / to_csv.
#include "stagewise/schedule/csv.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sched = stagewise::schedule;
using sched::Action;
using sched::ActionKind;
using stagewise::testing::contains;
using stagewise::testing::error_of;

static_assert(sched::placed_schedule<sched::csv_schedule>);

namespace {

// from_csv(to_csv(plan)) plans to the same programs and placement.
template <class S>
void round_trip(const S& s, int stages, int m, int checkpointed = 0) {
  CAPTURE(stages);
  CAPTURE(m);
  const auto p = sched::plan(s, stages, m, checkpointed);
  const auto text = sched::to_csv(p, /*recomputes=*/checkpointed > 0);
  const auto c = sched::from_csv(text);
  CHECK(c.stages == stages);
  CHECK(c.micro_batches == m);
  const auto q = sched::plan(c, stages, m, checkpointed);
  CHECK(q.workers == p.workers);
  CHECK(q.programs == p.programs);
  for (int k = 0; k < stages; ++k) CHECK(q.worker_of(k) == p.worker_of(k));
  CHECK(sched::to_csv(q, checkpointed > 0) == text);
}

std::string csv_error(const std::string& text) {
  return error_of([&] { (void)sched::from_csv(text); });
}

}  // namespace

TEST_SUITE("csv") {
  TEST_CASE("to_csv writes one row per rank on a one-step clock, idle steps empty") {
    CHECK(sched::to_csv(sched::plan(sched::one_f_one_b{}, 2, 2)) ==
          "0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1\n");
    CHECK(sched::to_csv(sched::plan(sched::zero_bubble_h1{}, 2, 2)) ==
          "0F0,0F1,,0I0,0W0,0I1,0W1\n,1F0,1I0,1F1,1I1,1W0,1W1\n");
    // Recomputes only on request: PyTorch has no recompute action.
    const auto p = sched::plan(sched::gpipe{}, 1, 1, 1);
    CHECK(sched::to_csv(p) == "0F0,0B0\n");
    CHECK(sched::to_csv(p, true) == "0F0,0R0,0B0\n");
  }

  TEST_CASE("every built-in schedule survives a round trip") {
    for (int k = 1; k <= 4; ++k) {
      for (int m : {1, 3, 8}) {
        round_trip(sched::gpipe{}, k, m);
        round_trip(sched::one_f_one_b{}, k, m);
        round_trip(sched::zero_bubble_h1{}, k, m);
        round_trip(sched::interleaved_one_f_one_b{2}, 2 * k, m);
        round_trip(sched::looped_bfs{2}, 2 * k, m);
        round_trip(sched::zero_bubble_v{}, 2 * k, m);
        if (m >= 2 * k) round_trip(sched::dualpipe_v{}, 2 * k, m);
        round_trip(sched::one_f_one_b{}, k, m, /*checkpointed=*/m);
        round_trip(sched::zero_bubble_v{}, 2 * k, m, /*checkpointed=*/m);
      }
    }
  }

  TEST_CASE("from_csv reads PyTorch's forms: spaces, CRLF, overlapped pairs, communication") {
    auto c = sched::from_csv(
        "0F0, 0F1 ,,\"0B0\",0B1\r\n"
        ",1F0,1RECV_F0,(1B0;1F1)OVERLAP_F_B,1SEND_B0,1B1,1UNSHARD,1REDUCE_GRAD\r\n");
    CHECK(c.stages == 2);
    CHECK(c.micro_batches == 2);
    CHECK(c.ranks[1] == std::vector<Action>{{1, ActionKind::forward, 0},
                                            {1, ActionKind::backward, 0},
                                            {1, ActionKind::forward, 1},
                                            {1, ActionKind::backward, 1}});
    CHECK_FALSE(sched::check(c, 2, 2));
    auto sim = sched::simulate(c, 2, 2);
    CHECK(sim.timeline.actions.size() == 8);
    CHECK(contains(error_of([&] { (void)sched::plan(c, 2, 4); }),
                   "the CSV schedule is for 2 stages and 2 micro-batches, asked for 2 and 4"));
  }

  TEST_CASE("a malformed cell is named by its row and column") {
    CHECK(csv_error("0F0,0B0\n1F0,1X0,1B0\n") ==
          "stagewise::schedule::from_csv: row 2 (rank 1), column 2: '1X0' is not an action: 'X' "
          "is not an action type (F, I, B, W, R, or a communication action); write "
          "<stage><F|I|B|W><micro-batch>, e.g. 0F1 for the forward of micro-batch 1 on stage 0");
    CHECK(contains(csv_error("0F0,,F1\n"),
                   "row 1 (rank 0), column 3: 'F1' is not an action: it does not start with a "
                   "stage number"));
    CHECK(
        contains(csv_error("0F0,0B\n"),
                 "row 1 (rank 0), column 2: '0B' is not an action: it has no micro-batch number"));
    CHECK(contains(csv_error("0F0,(0B0;0F1\n"),
                   "column 2: '(0B0;0F1' is not an action: a group of actions is written "
                   "(a;b)OVERLAP_F_B"));
    CHECK(contains(csv_error("0F0,0B0\n0F1,0B1\n"),
                   "row 2 (rank 1), column 1: '0F1' runs stage 0, whose actions are on rank 0 "
                   "(row 1); a stage lives on one rank"));
    CHECK(contains(csv_error("0F0,0B0\n2F0,2B0\n"), "stage 1 appears in no row, but stage 2 does"));
    CHECK(contains(csv_error("0F0,0B0\n,,\n1F0,1B0\n"), "row 2 (rank 1) has no action"));
    CHECK(contains(csv_error(""), "the text has no rows"));
    CHECK(contains(csv_error("0F99999999999\n"), "its numbers are too large"));
  }

  TEST_CASE("a schedule written by hand in PyTorch's format is verified before it runs") {
    // Rank 1 runs B0 before F0 reached it: a deadlock, named by the verifier.
    auto c = sched::from_csv("0F0,0B0\n1B0,1F0\n");
    CHECK(
        contains(error_of([&] { sched::verify(c, 2, 1); }), "B0@1 (action #2) comes before F0@1"));
  }
}
