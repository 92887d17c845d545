#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/transfer_kind.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace stagewise::schedule {

/// A skip connection's route: the stage that stashes the tensor and the (later) stage that pops
/// it; `none` (-1) for a side nobody declares. The one route type of the library: the skip
/// layer's `stagewise::skip_route` is this plus the skip it routes, and the pipes hand these to
/// `comms` and to their transports.
///   stagewise::schedule::SkipRoute{0, 2}  // stashed on stage 0, popped on stage 2
struct SkipRoute {
  static constexpr int none = -1;
  int stash_stage = none;
  int pop_stage = none;
  /// Whether the skip crosses stages (then it travels as a message of its own).
  constexpr bool requires_copy() const { return stash_stage != pop_stage; }
  friend constexpr bool operator==(const SkipRoute&, const SkipRoute&) = default;
};

/// One message of a training step: `kind` for micro-batch `micro` from stage `from` to stage
/// `to`; `skip` is the index of the route in the list given to `comms` (-1 for activations and
/// gradients).
struct Transfer {
  TransferKind kind = TransferKind::activation;
  int from = 0;
  int to = 0;
  int micro = 0;
  int skip = -1;
  friend auto operator<=>(const Transfer&, const Transfer&) = default;
};

/// Names a transfer for messages: "the activation of micro-batch 2 from stage 0 to stage 1".
inline std::string to_string(const Transfer& t) {
  std::string what;
  switch (t.kind) {
    case TransferKind::activation:
      what = "the activation";
      break;
    case TransferKind::gradient:
      what = "the gradient";
      break;
    case TransferKind::skip:
      what = "skip " + std::to_string(t.skip);
      break;
    case TransferKind::skip_grad:
      what = "the gradient of skip " + std::to_string(t.skip);
      break;
  }
  return what + " of micro-batch " + std::to_string(t.micro) + " from stage " +
         std::to_string(t.from) + " to stage " + std::to_string(t.to);
}

/// One communication of a worker: at `action`, send or receive `transfer`. Receives of an
/// action come before it runs, sends after it.
struct CommStep {
  bool send = false;
  Transfer transfer;
  Action action;
};

/// Each worker's sends and receives in the order it performs them, derived from a Plan (see
/// `comms`). Transfers between stages of one worker are included: they go through the local
/// mailbox but still order the worker's actions.
struct CommPlan {
  int stages = 0;
  int workers = 0;
  std::vector<std::vector<CommStep>> programs;  ///< per worker, in order
  std::vector<int> placement;                   ///< the Plan's; empty: stage k on k % workers
  /// The worker that runs `stage` (the Plan's placement).
  int worker_of(int stage) const {
    return placement.empty() ? stage % workers : placement[static_cast<std::size_t>(stage)];
  }
};

/// Derives every worker's ordered sends and receives from `plan`: F of stage j > 0 receives the
/// activation from stage j-1 and each skip popped there; F of a non-last stage sends its
/// activation and each skip stashed there. B or I of a non-last stage receives the gradient and
/// each skip gradient of a skip stashed there; B or I of a stage j > 0 sends the gradient back
/// and each skip gradient of a skip popped there. R and W communicate nothing.
///   auto c = stagewise::schedule::comms(stagewise::schedule::plan(one_f_one_b{}, 2, 4));
///   c.programs[1][0];  // worker 1 first receives the activation of micro-batch 0
inline CommPlan comms(const Plan& plan, const std::vector<SkipRoute>& routes = {}) {
  CommPlan c{plan.stages, plan.workers,
             std::vector<std::vector<CommStep>>(static_cast<std::size_t>(plan.workers)),
             plan.placement};
  const int n = plan.stages;
  for (std::size_t w = 0; w < plan.programs.size(); ++w) {
    auto& out = c.programs[w];
    for (const Action& a : plan.programs[w]) {
      const int j = a.stage;
      auto add = [&](bool send, TransferKind kind, int from, int to, int skip) {
        out.push_back({send, Transfer{kind, from, to, a.micro, skip}, a});
      };
      if (a.kind == ActionKind::forward) {
        if (j > 0) add(false, TransferKind::activation, j - 1, j, -1);
        for (std::size_t r = 0; r < routes.size(); ++r) {
          const auto& s = routes[r];
          if (s.pop_stage == j && s.stash_stage != j) {
            add(false, TransferKind::skip, s.stash_stage, j, static_cast<int>(r));
          }
        }
        if (j < n - 1) add(true, TransferKind::activation, j, j + 1, -1);
        for (std::size_t r = 0; r < routes.size(); ++r) {
          const auto& s = routes[r];
          if (s.stash_stage == j && s.pop_stage != j) {
            add(true, TransferKind::skip, j, s.pop_stage, static_cast<int>(r));
          }
        }
      } else if (a.kind == ActionKind::backward || a.kind == ActionKind::input_grad) {
        if (j < n - 1) add(false, TransferKind::gradient, j + 1, j, -1);
        for (std::size_t r = 0; r < routes.size(); ++r) {
          const auto& s = routes[r];
          if (s.stash_stage == j && s.pop_stage != j) {
            add(false, TransferKind::skip_grad, s.pop_stage, j, static_cast<int>(r));
          }
        }
        if (j > 0) add(true, TransferKind::gradient, j, j - 1, -1);
        for (std::size_t r = 0; r < routes.size(); ++r) {
          const auto& s = routes[r];
          if (s.pop_stage == j && s.stash_stage != j) {
            add(true, TransferKind::skip_grad, j, s.stash_stage, static_cast<int>(r));
          }
        }
      }
    }
  }
  return c;
}

namespace detail {

inline std::string where(const CommPlan& c, const CommStep& s) {
  return to_string(s.action) + " on worker " + std::to_string(c.worker_of(s.action.stage));
}

inline std::optional<std::string> route_problem(const std::vector<SkipRoute>& routes, int n) {
  for (std::size_t r = 0; r < routes.size(); ++r) {
    const auto& s = routes[r];
    if (s.stash_stage < 0 || s.pop_stage >= n || s.stash_stage > s.pop_stage) {
      return "skip route " + std::to_string(r) + " goes from stage " +
             std::to_string(s.stash_stage) + " to stage " + std::to_string(s.pop_stage) +
             "; a skip is popped on its stash stage or a later one, within stages 0.." +
             std::to_string(n - 1);
    }
  }
  return std::nullopt;
}

// Every cross-worker send has its receive and vice versa, in the same order on each link (one
// kind of message from one stage to another, e.g. stage 1's activations to stage 2), so a
// transport may pre-post a link's receives in the order the messages are sent.
inline std::string link_name(const Transfer& t) {
  const char* what = t.kind == TransferKind::activation ? "activations"
                     : t.kind == TransferKind::gradient ? "gradients"
                     : t.kind == TransferKind::skip     ? "skip"
                                                        : "gradients of skip";
  return std::string(what) + (t.skip >= 0 ? " " + std::to_string(t.skip) : "") + " from stage " +
         std::to_string(t.from) + " to stage " + std::to_string(t.to);
}

inline std::optional<std::string> matching_problem(const CommPlan& c) {
  using link = std::tuple<TransferKind, int, int, int>;
  std::map<link, std::vector<const CommStep*>> sends, recvs;
  for (const auto& program : c.programs) {
    for (const auto& s : program) {
      const Transfer& t = s.transfer;
      if (c.worker_of(t.from) == c.worker_of(t.to)) continue;
      (s.send ? sends : recvs)[{t.kind, t.from, t.to, t.skip}].push_back(&s);
    }
  }
  for (auto& [l, out] : sends) {
    const auto& in = recvs[l];
    std::set<Transfer> received;
    for (const auto* s : in) received.insert(s->transfer);
    for (const auto* s : out) {
      if (!received.count(s->transfer)) {
        return where(c, *s) + " sends " + to_string(s->transfer) +
               ", which no action receives; the receiving stage's F (activations, skips) or "
               "B/I (gradients) must be in the plan";
      }
    }
    for (std::size_t k = 0; k < std::min(out.size(), in.size()); ++k) {
      if (out[k]->transfer != in[k]->transfer) {
        return "on the link of " + link_name(out[k]->transfer) + ", message #" + std::to_string(k) +
               " is micro-batch " + std::to_string(out[k]->transfer.micro) + " (sent at " +
               where(c, *out[k]) + ") but " + where(c, *in[k]) + " receives micro-batch " +
               std::to_string(in[k]->transfer.micro) +
               " there; order the receiving stage's actions like the sending stage's";
      }
    }
  }
  for (auto& [l, in] : recvs) {
    const auto& out = sends[l];
    if (in.size() > out.size()) {
      const auto* s = in[out.size()];
      return where(c, *s) + " receives " + to_string(s->transfer) +
             ", which no action sends; the sending stage's F (activations, skips) or B/I "
             "(gradients) must be in the plan";
    }
  }
  return std::nullopt;
}

// Runs every worker's communications with blocking receives and sends that never block; the
// first receive that can never complete is a deadlock.
inline std::optional<std::string> blocking_problem(const CommPlan& c) {
  const auto workers = c.programs.size();
  std::vector<std::size_t> next(workers, 0);
  std::set<Transfer> sent;
  std::map<Transfer, const CommStep*> sender;
  for (const auto& program : c.programs) {
    for (const auto& s : program) {
      if (s.send) sender[s.transfer] = &s;
    }
  }
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t w = 0; w < workers; ++w) {
      const auto& program = c.programs[w];
      while (next[w] < program.size()) {
        const CommStep& s = program[next[w]];
        if (s.send) {
          sent.insert(s.transfer);
        } else if (!sent.count(s.transfer)) {
          break;
        }
        ++next[w];
        moved = true;
      }
    }
  }
  std::string stuck;
  const CommStep* first = nullptr;
  for (std::size_t w = 0; w < workers; ++w) {
    if (next[w] >= c.programs[w].size()) continue;
    const CommStep& s = c.programs[w][next[w]];
    if (!first) first = &s;
    const auto it = sender.find(s.transfer);
    stuck += (stuck.empty() ? "" : "; ") + std::string("worker ") + std::to_string(w) +
             " waits at " + to_string(s.action) + " for " + to_string(s.transfer) +
             (it == sender.end() ? std::string(", which nothing sends")
                                 : ", sent at " + to_string(it->second->action));
  }
  if (!first) return std::nullopt;
  return "deadlock at " + where(c, *first) + ": no worker can go on (" + stuck +
         "). Order each worker's actions so that every message is sent before a worker waits for "
         "it";
}

}  // namespace detail

/// What could make the workers of `plan` wait forever on each other's messages, or nothing:
/// a send without its receive (or the reverse), two messages received in another order than
/// they were sent on one link (one kind of message between two stages), or a deadlock found by
/// running every worker's receives as blocking waits. The message names the first action that would
/// wait.
///   if (auto problem = stagewise::schedule::check_comms(p, {{0, 2}})) std::cerr << *problem;
inline std::optional<std::string> check_comms(const Plan& plan,
                                              const std::vector<SkipRoute>& routes = {}) {
  if (auto p = detail::route_problem(routes, plan.stages)) return p;
  const CommPlan c = comms(plan, routes);
  if (auto p = detail::matching_problem(c)) return p;
  return detail::blocking_problem(c);
}

/// Rejects a plan whose workers could wait forever on each other's messages (see
/// `check_comms`), throwing c10::Error that names the first such action. The distributed pipe
/// calls it on every plan before a step runs.
///   stagewise::schedule::verify_comms(stagewise::schedule::plan(gpipe{}, 4, 8), {{0, 3}});
inline void verify_comms(const Plan& plan, const std::vector<SkipRoute>& routes = {}) {
  const auto problem = check_comms(plan, routes);
  TORCH_CHECK(!problem, "stagewise::schedule::verify_comms: ", problem.value_or(""));
}

}  // namespace stagewise::schedule
