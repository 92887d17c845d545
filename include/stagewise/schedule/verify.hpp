#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/detail/replay.hpp"

#include <c10/util/Exception.h>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace stagewise::schedule {

namespace detail {

inline std::string at(const Action& a, std::size_t position) {
  return to_string(a) + " (action #" + std::to_string(position) + ")";
}

inline bool known_kind(ActionKind k) {
  switch (k) {
    case ActionKind::forward:
    case ActionKind::backward:
    case ActionKind::input_grad:
    case ActionKind::weight_grad:
    case ActionKind::recompute:
    case ActionKind::offload:
    case ActionKind::reload:
      return true;
  }
  return false;
}

// The first use of what a cell keeps (its R, or its first B or I) when that cell was offloaded
// and not reloaded yet: a reload that comes later (after its use), or none at all.
inline std::string used_while_away(const Action& a, std::size_t p, std::size_t reload_at) {
  const Action o{a.stage, ActionKind::offload, a.micro};
  const Action l{a.stage, ActionKind::reload, a.micro};
  if (reload_at != static_cast<std::size_t>(-1)) {
    return at(l, reload_at) + " comes after " + at(a, p) + ", which uses what " + to_string(o) +
           " moved to the host; a reload must land before its use, so yield " + to_string(l) +
           " before " + to_string(a);
  }
  return to_string(o) + " is never reloaded, but " + at(a, p) + " uses what it moved to the " +
         "host; yield " + to_string(l) + " between " + to_string(o) + " and " + to_string(a) +
         ", or drop the offload";
}

// The first thing wrong with a schedule's stream of actions, or nothing. Checks, in the order
// the actions were yielded: each action inside the grid and of a known kind; per stage a cell's
// F before its B or I, I before W, a recompute R between the cell's F and its first B or I, and
// nothing twice; then that every cell ran (F, and B or I+W); then, on a virtual clock with each
// stage on its worker (`placement`), that no worker waits for something that can never come.
inline std::optional<std::string> first_problem(const std::vector<Action>& actions, int n, int m,
                                                const std::vector<int>& placement, int workers) {
  if (n < 1 || m < 1) {
    return "a pipeline needs at least 1 stage and 1 micro-batch, got " + std::to_string(n) +
           " stages and " + std::to_string(m) + " micro-batches";
  }
  if (auto bad = placement_problem(placement, n, workers); !bad.empty()) return bad;
  enum : unsigned { f = 1, b = 2, i = 4, w = 8, rc = 16, o = 32, l = 64 };
  std::vector<unsigned> seen(static_cast<std::size_t>(n) * static_cast<std::size_t>(m), 0);
  auto name = [](ActionKind k, int stage, int micro) { return to_string(Action{stage, k, micro}); };
  // Where each cell's first reload is, to tell a late reload from a missing one.
  std::vector<std::size_t> reload_at(seen.size(), static_cast<std::size_t>(-1));
  for (std::size_t p = actions.size(); p-- > 0;) {
    const Action& a = actions[p];
    if (a.kind == ActionKind::reload && a.stage >= 0 && a.stage < n && a.micro >= 0 &&
        a.micro < m) {
      reload_at[static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(m) +
                static_cast<std::size_t>(a.micro)] = p;
    }
  }
  for (std::size_t p = 0; p < actions.size(); ++p) {
    const Action& a = actions[p];
    if (!known_kind(a.kind)) {
      return "action #" + std::to_string(p) + " has the unknown kind '" +
             std::string(1, static_cast<char>(a.kind)) +
             "'; yield ActionKind::forward, backward, input_grad, weight_grad, recompute, "
             "offload or reload";
    }
    if (a.stage < 0 || a.stage >= n || a.micro < 0 || a.micro >= m) {
      return at(a, p) + " is outside the pipeline of " + std::to_string(n) + " stages and " +
             std::to_string(m) + " micro-batches; yield stages 0.." + std::to_string(n - 1) +
             " and micro-batches 0.." + std::to_string(m - 1);
    }
    const std::size_t index = static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(m) +
                              static_cast<std::size_t>(a.micro);
    auto& cell = seen[index];
    const std::string where = " on stage " + std::to_string(a.stage);
    const bool uses_kept =
        a.kind == ActionKind::recompute ||
        ((a.kind == ActionKind::backward || a.kind == ActionKind::input_grad) && !(cell & rc));
    if (uses_kept && (cell & f) && (cell & o) && !(cell & l) && !(cell & (b | i))) {
      return used_while_away(a, p, reload_at[index]);
    }
    switch (a.kind) {
      case ActionKind::forward:
        if (cell & f) {
          return at(a, p) + " repeats the forward of micro-batch " + std::to_string(a.micro) +
                 where + "; every cell runs forward exactly once";
        }
        cell |= f;
        break;
      case ActionKind::backward:
      case ActionKind::input_grad:
        if (!(cell & f)) {
          return at(a, p) + " comes before " + name(ActionKind::forward, a.stage, a.micro) + where +
                 "; a stage runs a micro-batch's forward before its backward (B or I)";
        }
        if (cell & (b | i)) {
          return at(a, p) + " repeats the backward of micro-batch " + std::to_string(a.micro) +
                 where + "; give each cell one B, or one I followed by one W";
        }
        cell |= a.kind == ActionKind::backward ? b : i;
        break;
      case ActionKind::weight_grad:
        if (cell & b) {
          return at(a, p) + " follows " + name(ActionKind::backward, a.stage, a.micro) +
                 ", which already computed the weight gradients; give each cell one B, or one I "
                 "followed by one W";
        }
        if (!(cell & i)) {
          return at(a, p) + " comes before " + name(ActionKind::input_grad, a.stage, a.micro) +
                 where + "; W uses what I kept, so yield " +
                 name(ActionKind::input_grad, a.stage, a.micro) + " first";
        }
        if (cell & w) {
          return at(a, p) + " repeats the weight gradient of micro-batch " +
                 std::to_string(a.micro) + where + "; give each cell one W after its I";
        }
        cell |= w;
        break;
      case ActionKind::recompute:
        if (!(cell & f)) {
          return at(a, p) + " comes before " + name(ActionKind::forward, a.stage, a.micro) + where +
                 "; a recompute re-runs a forward, so yield it after " +
                 name(ActionKind::forward, a.stage, a.micro) + " and before " +
                 name(ActionKind::backward, a.stage, a.micro) + " or " +
                 name(ActionKind::input_grad, a.stage, a.micro);
        }
        if (cell & (b | i)) {
          return at(a, p) + " follows " +
                 name(cell & b ? ActionKind::backward : ActionKind::input_grad, a.stage, a.micro) +
                 "; the first backward of a checkpointed cell uses what its recompute rebuilds, "
                 "so yield the R before it";
        }
        if (cell & rc) {
          return at(a, p) + " repeats the recompute of micro-batch " + std::to_string(a.micro) +
                 where + "; give each checkpointed cell at most one R";
        }
        cell |= rc;
        break;
      case ActionKind::offload:
        if (!(cell & f)) {
          return at(a, p) + " comes before " + name(ActionKind::forward, a.stage, a.micro) + where +
                 "; an offload moves what the forward kept, so yield it after " +
                 name(ActionKind::forward, a.stage, a.micro);
        }
        if (cell & (b | i | rc)) {
          return at(a, p) + " follows the cell's " + (cell & rc ? "recompute" : "backward") +
                 ", which already used what it would move; offload between " +
                 name(ActionKind::forward, a.stage, a.micro) +
                 " and the cell's recompute or first backward";
        }
        if (cell & o) {
          return at(a, p) + " repeats the offload of micro-batch " + std::to_string(a.micro) +
                 where + "; offload each cell at most once";
        }
        cell |= o;
        break;
      case ActionKind::reload:
        if (!(cell & o)) {
          return at(a, p) + " reloads micro-batch " + std::to_string(a.micro) + where +
                 ", which has not been offloaded; yield " +
                 name(ActionKind::offload, a.stage, a.micro) + " (after " +
                 name(ActionKind::forward, a.stage, a.micro) + ") before it, or drop the reload";
        }
        if (cell & l) {
          return at(a, p) + " repeats the reload of micro-batch " + std::to_string(a.micro) +
                 where + "; reload each offloaded cell exactly once";
        }
        cell |= l;
        break;
    }
  }
  for (int s = 0; s < n; ++s) {
    for (int k = 0; k < m; ++k) {
      const unsigned cell = seen[static_cast<std::size_t>(s) * static_cast<std::size_t>(m) +
                                 static_cast<std::size_t>(k)];
      if (!(cell & f)) {
        return name(ActionKind::forward, s, k) +
               " never comes; every micro-batch runs forward on every stage";
      }
      if (!(cell & (b | i))) {
        return "no backward of micro-batch " + std::to_string(k) + " on stage " +
               std::to_string(s) + "; yield " + name(ActionKind::backward, s, k) + ", or " +
               name(ActionKind::input_grad, s, k) + " and then " +
               name(ActionKind::weight_grad, s, k);
      }
      if ((cell & o) && !(cell & l)) {
        return name(ActionKind::offload, s, k) + " is never reloaded; yield " +
               name(ActionKind::reload, s, k) + " before the cell's recompute or first backward";
      }
      if ((cell & i) && !(cell & w)) {
        return name(ActionKind::weight_grad, s, k) + " never comes; " +
               name(ActionKind::input_grad, s, k) + " left the weight gradients of micro-batch " +
               std::to_string(k) + " on stage " + std::to_string(s) + " to a W";
      }
    }
  }
  // Deadlock: replay each worker's list in order on a unit clock.
  std::vector<std::vector<Action>> programs(static_cast<std::size_t>(workers));
  std::vector<std::vector<std::size_t>> positions(static_cast<std::size_t>(workers));
  for (std::size_t p = 0; p < actions.size(); ++p) {
    const auto wk = static_cast<std::size_t>(placement[static_cast<std::size_t>(actions[p].stage)]);
    programs[wk].push_back(actions[p]);
    positions[wk].push_back(p);
  }
  Dependencies deps(n, m);
  const Replay r = replay(programs, deps, [](const Action&) { return 1.0; });
  if (r.complete) return std::nullopt;
  std::size_t first = actions.size();
  std::string stuck;
  for (std::size_t wk = 0; wk < programs.size(); ++wk) {
    if (r.next[wk] >= programs[wk].size()) continue;
    const Action& a = programs[wk][r.next[wk]];
    first = std::min(first, positions[wk][r.next[wk]]);
    stuck += (stuck.empty() ? "" : "; ") + std::string("worker ") + std::to_string(wk) +
             " waits at " + to_string(a) + " for " + deps.needs(a);
  }
  return "deadlock at " + at(actions[first], first) + ": after " + std::to_string(r.timed.size()) +
         " actions no worker can go on (" + stuck +
         "). Order each worker's actions so that what an action waits for runs earlier";
}

template <pipeline_schedule S>
std::vector<Action> collect(const S& sched, int stages, int micro_batches) {
  std::vector<Action> out;
  for (const auto& a : sched(stages, micro_batches)) out.push_back(a);
  return out;
}

}  // namespace detail

/// What is wrong with schedule `sched` for `stages` stages and `micro_batches` micro-batches, or
/// nothing when it is valid; the message names the first bad action. See `verify`.
///   if (auto problem = stagewise::schedule::check(my_schedule{}, 4, 8)) std::cerr << *problem;
template <pipeline_schedule S>
std::optional<std::string> check(const S& sched, int stages, int micro_batches) {
  const int workers = workers_of(sched, stages);
  return detail::first_problem(detail::collect(sched, stages, micro_batches), stages, micro_batches,
                               placement_of(sched, stages), workers);
}

/// Rejects an invalid schedule before anything runs, throwing c10::Error with a message naming
/// the first bad action: an action outside the grid, a cell's B or I before its F or W before
/// its I, a recompute R not between its cell's F and first B or I, an offload O not between them
/// or a reload L not between the O and the cell's R (or first B or I; each O reloaded exactly
/// once, on its stage), a cell run twice or never, a
/// placement naming a worker out of range, or a deadlock (a worker waiting for something that can
/// never come). `train_step` calls it on every schedule it runs.
///   stagewise::schedule::verify(stagewise::schedule::one_f_one_b{}, 4, 8);  // fine
///   // "stagewise::schedule::verify: B3@1 (action #9) comes before F3@1 on stage 1; ..."
template <pipeline_schedule S>
void verify(const S& sched, int stages, int micro_batches) {
  const auto problem = check(sched, stages, micro_batches);
  TORCH_CHECK(!problem, "stagewise::schedule::verify: ", problem.value_or(""));
}

}  // namespace stagewise::schedule
