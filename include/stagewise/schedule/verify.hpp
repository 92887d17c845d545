#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/detail/replay.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
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

// What a cell (stage, micro-batch) has run so far, one bit per kind of action.
struct Ran {
  enum : unsigned { f = 1, b = 2, i = 4, w = 8, r = 16, o = 32, l = 64 };
};

inline std::size_t cell_index(int stage, int micro, int m) {
  return static_cast<std::size_t>(stage) * static_cast<std::size_t>(m) +
         static_cast<std::size_t>(micro);
}

inline std::string action_name(ActionKind k, int stage, int micro) {
  return to_string(Action{stage, k, micro});
}

// Rule: a pipeline has at least one stage and one micro-batch.
inline std::string empty_grid_problem(int n, int m) {
  if (n >= 1 && m >= 1) return "";
  return "a pipeline needs at least 1 stage and 1 micro-batch, got " + std::to_string(n) +
         " stages and " + std::to_string(m) + " micro-batches";
}

// Rule: every action is of a known kind and inside the grid of n stages and m micro-batches.
inline std::string action_problem(const Action& a, std::size_t p, int n, int m) {
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
  return "";
}

// Where each cell's first reload is (or -1), to tell a late reload from a missing one.
inline std::vector<std::size_t> first_reloads(const std::vector<Action>& actions, int n, int m) {
  std::vector<std::size_t> reload_at(static_cast<std::size_t>(n) * static_cast<std::size_t>(m),
                                     static_cast<std::size_t>(-1));
  for (std::size_t p = actions.size(); p-- > 0;) {
    const Action& a = actions[p];
    if (a.kind == ActionKind::reload && a.stage >= 0 && a.stage < n && a.micro >= 0 &&
        a.micro < m) {
      reload_at[cell_index(a.stage, a.micro, m)] = p;
    }
  }
  return reload_at;
}

// Rule: the first use of what a cell keeps (its R, or its first B or I) does not come while the
// cell is offloaded and not reloaded yet: a reload that comes later (after its use), or none.
inline std::string used_while_away(const Action& a, std::size_t p, unsigned cell,
                                   std::size_t reload_at) {
  const bool uses_kept =
      a.kind == ActionKind::recompute ||
      ((a.kind == ActionKind::backward || a.kind == ActionKind::input_grad) && !(cell & Ran::r));
  if (!uses_kept || !(cell & Ran::f) || !(cell & Ran::o) || (cell & Ran::l) ||
      (cell & (Ran::b | Ran::i))) {
    return "";
  }
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

inline std::string on_stage(const Action& a) {
  return " on stage " + std::to_string(a.stage);
}

// Rule: a cell runs its forward exactly once.
inline std::string forward_problem(const Action& a, std::size_t p, unsigned cell) {
  if (!(cell & Ran::f)) return "";
  return at(a, p) + " repeats the forward of micro-batch " + std::to_string(a.micro) + on_stage(a) +
         "; every cell runs forward exactly once";
}

// Rule: a cell's backward (one B, or one I) comes after its forward, once.
inline std::string backward_problem(const Action& a, std::size_t p, unsigned cell) {
  if (!(cell & Ran::f)) {
    return at(a, p) + " comes before " + action_name(ActionKind::forward, a.stage, a.micro) +
           on_stage(a) + "; a stage runs a micro-batch's forward before its backward (B or I)";
  }
  if (cell & (Ran::b | Ran::i)) {
    return at(a, p) + " repeats the backward of micro-batch " + std::to_string(a.micro) +
           on_stage(a) + "; give each cell one B, or one I followed by one W";
  }
  return "";
}

// Rule: a W follows its cell's I (not a B), once.
inline std::string weight_grad_problem(const Action& a, std::size_t p, unsigned cell) {
  if (cell & Ran::b) {
    return at(a, p) + " follows " + action_name(ActionKind::backward, a.stage, a.micro) +
           ", which already computed the weight gradients; give each cell one B, or one I "
           "followed by one W";
  }
  if (!(cell & Ran::i)) {
    return at(a, p) + " comes before " + action_name(ActionKind::input_grad, a.stage, a.micro) +
           on_stage(a) + "; W uses what I kept, so yield " +
           action_name(ActionKind::input_grad, a.stage, a.micro) + " first";
  }
  if (cell & Ran::w) {
    return at(a, p) + " repeats the weight gradient of micro-batch " + std::to_string(a.micro) +
           on_stage(a) + "; give each cell one W after its I";
  }
  return "";
}

// Rule: a recompute R comes between its cell's F and first backward, at most once.
inline std::string recompute_problem(const Action& a, std::size_t p, unsigned cell) {
  if (!(cell & Ran::f)) {
    return at(a, p) + " comes before " + action_name(ActionKind::forward, a.stage, a.micro) +
           on_stage(a) + "; a recompute re-runs a forward, so yield it after " +
           action_name(ActionKind::forward, a.stage, a.micro) + " and before " +
           action_name(ActionKind::backward, a.stage, a.micro) + " or " +
           action_name(ActionKind::input_grad, a.stage, a.micro);
  }
  if (cell & (Ran::b | Ran::i)) {
    return at(a, p) + " follows " +
           action_name(cell & Ran::b ? ActionKind::backward : ActionKind::input_grad, a.stage,
                       a.micro) +
           "; the first backward of a checkpointed cell uses what its recompute rebuilds, "
           "so yield the R before it";
  }
  if (cell & Ran::r) {
    return at(a, p) + " repeats the recompute of micro-batch " + std::to_string(a.micro) +
           on_stage(a) + "; give each checkpointed cell at most one R";
  }
  return "";
}

// Rule: an offload O comes between its cell's F and its recompute or first backward, at most
// once.
inline std::string offload_problem(const Action& a, std::size_t p, unsigned cell) {
  if (!(cell & Ran::f)) {
    return at(a, p) + " comes before " + action_name(ActionKind::forward, a.stage, a.micro) +
           on_stage(a) + "; an offload moves what the forward kept, so yield it after " +
           action_name(ActionKind::forward, a.stage, a.micro);
  }
  if (cell & (Ran::b | Ran::i | Ran::r)) {
    return at(a, p) + " follows the cell's " + (cell & Ran::r ? "recompute" : "backward") +
           ", which already used what it would move; offload between " +
           action_name(ActionKind::forward, a.stage, a.micro) +
           " and the cell's recompute or first backward";
  }
  if (cell & Ran::o) {
    return at(a, p) + " repeats the offload of micro-batch " + std::to_string(a.micro) +
           on_stage(a) + "; offload each cell at most once";
  }
  return "";
}

// Rule: a reload L follows its cell's offload, once.
inline std::string reload_problem(const Action& a, std::size_t p, unsigned cell) {
  if (!(cell & Ran::o)) {
    return at(a, p) + " reloads micro-batch " + std::to_string(a.micro) + on_stage(a) +
           ", which has not been offloaded; yield " +
           action_name(ActionKind::offload, a.stage, a.micro) + " (after " +
           action_name(ActionKind::forward, a.stage, a.micro) + ") before it, or drop the reload";
  }
  if (cell & Ran::l) {
    return at(a, p) + " repeats the reload of micro-batch " + std::to_string(a.micro) +
           on_stage(a) + "; reload each offloaded cell exactly once";
  }
  return "";
}

// The rule for an action of kind a.kind against what its cell ran before, and the bit it sets.
inline std::string order_problem(const Action& a, std::size_t p, unsigned cell) {
  switch (a.kind) {
    case ActionKind::forward:
      return forward_problem(a, p, cell);
    case ActionKind::backward:
    case ActionKind::input_grad:
      return backward_problem(a, p, cell);
    case ActionKind::weight_grad:
      return weight_grad_problem(a, p, cell);
    case ActionKind::recompute:
      return recompute_problem(a, p, cell);
    case ActionKind::offload:
      return offload_problem(a, p, cell);
    case ActionKind::reload:
      return reload_problem(a, p, cell);
  }
  return "";
}

inline unsigned ran_bit(ActionKind k) {
  switch (k) {
    case ActionKind::forward:
      return Ran::f;
    case ActionKind::backward:
      return Ran::b;
    case ActionKind::input_grad:
      return Ran::i;
    case ActionKind::weight_grad:
      return Ran::w;
    case ActionKind::recompute:
      return Ran::r;
    case ActionKind::offload:
      return Ran::o;
    case ActionKind::reload:
      return Ran::l;
  }
  return 0;
}

// The rules of each action in the order yielded (known kind, inside the grid, its cell's order);
// `ran` gets what each cell ran.
inline std::string sequence_problem(const std::vector<Action>& actions, int n, int m,
                                    std::vector<unsigned>& ran) {
  ran.assign(static_cast<std::size_t>(n) * static_cast<std::size_t>(m), 0);
  const std::vector<std::size_t> reload_at = first_reloads(actions, n, m);
  for (std::size_t p = 0; p < actions.size(); ++p) {
    const Action& a = actions[p];
    if (auto bad = action_problem(a, p, n, m); !bad.empty()) return bad;
    const std::size_t index = cell_index(a.stage, a.micro, m);
    unsigned& cell = ran[index];
    if (auto bad = used_while_away(a, p, cell, reload_at[index]); !bad.empty()) return bad;
    if (auto bad = order_problem(a, p, cell); !bad.empty()) return bad;
    cell |= ran_bit(a.kind);
  }
  return "";
}

// Rule: every cell ran: its F, a B or an I and its W, and a reload after an offload.
inline std::string unfinished_cell(const std::vector<unsigned>& ran, int n, int m) {
  for (int s = 0; s < n; ++s) {
    for (int k = 0; k < m; ++k) {
      const unsigned cell = ran[cell_index(s, k, m)];
      if (!(cell & Ran::f)) {
        return action_name(ActionKind::forward, s, k) +
               " never comes; every micro-batch runs forward on every stage";
      }
      if (!(cell & (Ran::b | Ran::i))) {
        return "no backward of micro-batch " + std::to_string(k) + " on stage " +
               std::to_string(s) + "; yield " + action_name(ActionKind::backward, s, k) + ", or " +
               action_name(ActionKind::input_grad, s, k) + " and then " +
               action_name(ActionKind::weight_grad, s, k);
      }
      if ((cell & Ran::o) && !(cell & Ran::l)) {
        return action_name(ActionKind::offload, s, k) + " is never reloaded; yield " +
               action_name(ActionKind::reload, s, k) +
               " before the cell's recompute or first backward";
      }
      if ((cell & Ran::i) && !(cell & Ran::w)) {
        return action_name(ActionKind::weight_grad, s, k) + " never comes; " +
               action_name(ActionKind::input_grad, s, k) +
               " left the weight gradients of micro-batch " + std::to_string(k) + " on stage " +
               std::to_string(s) + " to a W";
      }
    }
  }
  return "";
}

// Rule: no worker waits for something that can never come (each worker's list replayed in order
// on a unit clock, each stage on its worker).
inline std::string deadlock_problem(const std::vector<Action>& actions, int n, int m,
                                    const std::vector<int>& placement, int workers) {
  std::vector<std::vector<Action>> programs(static_cast<std::size_t>(workers));
  std::vector<std::vector<std::size_t>> positions(static_cast<std::size_t>(workers));
  for (std::size_t p = 0; p < actions.size(); ++p) {
    const auto wk = static_cast<std::size_t>(placement[static_cast<std::size_t>(actions[p].stage)]);
    programs[wk].push_back(actions[p]);
    positions[wk].push_back(p);
  }
  Dependencies deps(n, m);
  const Replay r = replay(programs, deps, [](const Action&) { return 1.0; });
  if (r.complete) return "";
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

// The first thing wrong with a schedule's stream of actions, or nothing: the rules above in turn.
// Checks, in the order the actions were yielded: each action inside the grid and of a known kind;
// per stage a cell's F before its B or I, I before W, a recompute R between the cell's F and its
// first B or I, and nothing twice; then that every cell ran (F, and B or I+W); then, on a virtual
// clock with each stage on its worker (`placement`), that no worker waits for something that can
// never come.
inline std::optional<std::string> first_problem(const std::vector<Action>& actions, int n, int m,
                                                const std::vector<int>& placement, int workers) {
  std::vector<unsigned> ran;
  std::string bad = empty_grid_problem(n, m);
  if (bad.empty()) bad = placement_problem(placement, n, workers);
  if (bad.empty()) bad = sequence_problem(actions, n, m, ran);
  if (bad.empty()) bad = unfinished_cell(ran, n, m);
  if (bad.empty()) bad = deadlock_problem(actions, n, m, placement, workers);
  if (bad.empty()) return std::nullopt;
  return bad;
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
