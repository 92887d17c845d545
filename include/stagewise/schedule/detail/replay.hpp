#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/timeline.hpp"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace stagewise::schedule::detail {

// Runs per-worker action lists on a virtual clock: each worker performs its list in order, an
// action starts once its worker is free and what it needs has ended, and lasts cost(action).
// What an action needs (the data dependencies of a pipeline):
//   F(i, s)      F(i, s-1)                      the activation from the previous stage
//   B/I(i, s)    F(i, s) and B/I(i, s+1)        its own forward, the gradient from the next stage
//   W(i, s)      I(i, s)                        what the input-gradient pass kept
//   R(i, s)      F(i, s)                        the kept input
//   O(i, s)      F(i, s)                        the kept input, to move to the host
//   L(i, s)      O(i, s)                        the copy on the host
// and an offloaded cell's R, B or I needs its L too (its input is back on the device).
// Copies (O, L) do not hold up their worker: the worker issues them in program order and goes
// on, and each runs on the worker's copy lane for its direction (device-to-host, host-to-device)
// once that lane is free, as a copy stream runs beside the compute stream.
// When no worker can go on before every list is done, the schedule deadlocks; `next` then tells
// where each worker is stuck. The verifier and the simulator share this.
struct Replay {
  std::vector<TimedAction> timed;  // in the order they were placed
  std::vector<std::size_t> next;   // per worker: index of the first action not run
  bool complete = true;
};

class Dependencies {
 public:
  Dependencies(int stages, int micro_batches)
      : n_(stages),
        m_(micro_batches),
        forward_(cells(), -1.0),
        grad_(cells(), -1.0),
        input_(cells(), -1.0),
        offloaded_(cells(), -1.0),
        reloaded_(cells(), -1.0) {}

  // When `a` may start as far as its inputs go, or nothing if one has not ended.
  std::optional<double> ready(const Action& a) const {
    double t = 0.0;
    auto need = [&](const std::vector<double>& ends, int stage) {
      const double e = ends[index(stage, a.micro)];
      if (e < 0.0) return false;
      t = std::max(t, e);
      return true;
    };
    switch (a.kind) {
      case ActionKind::forward:
        if (a.stage > 0 && !need(forward_, a.stage - 1)) return std::nullopt;
        break;
      case ActionKind::backward:
      case ActionKind::input_grad:
        if (!need(forward_, a.stage)) return std::nullopt;
        if (a.stage + 1 < n_ && !need(grad_, a.stage + 1)) return std::nullopt;
        if (!back_on_device(a, need)) return std::nullopt;
        break;
      case ActionKind::weight_grad:
        if (!need(input_, a.stage)) return std::nullopt;
        break;
      case ActionKind::recompute:
        if (!need(forward_, a.stage)) return std::nullopt;
        if (!back_on_device(a, need)) return std::nullopt;
        break;
      case ActionKind::offload:
        if (!need(forward_, a.stage)) return std::nullopt;
        break;
      case ActionKind::reload:
        if (!need(offloaded_, a.stage)) return std::nullopt;
        break;
    }
    return t;
  }

  void finish(const Action& a, double end) {
    const auto k = index(a.stage, a.micro);
    switch (a.kind) {
      case ActionKind::forward:
        forward_[k] = end;
        break;
      case ActionKind::backward:
        grad_[k] = end;
        break;
      case ActionKind::input_grad:
        grad_[k] = end;
        input_[k] = end;
        break;
      case ActionKind::offload:
        offloaded_[k] = end;
        break;
      case ActionKind::reload:
        reloaded_[k] = end;
        break;
      default:
        break;
    }
  }

  // Words for what `a` waits for, e.g. "B3@2 or I3@2".
  std::string needs(const Action& a) const {
    auto name = [&](ActionKind k, int stage) { return to_string(Action{stage, k, a.micro}); };
    switch (a.kind) {
      case ActionKind::forward:
        return name(ActionKind::forward, a.stage - 1);
      case ActionKind::backward:
      case ActionKind::input_grad:
        if (forward_[index(a.stage, a.micro)] < 0.0) return name(ActionKind::forward, a.stage);
        if (away(a)) return name(ActionKind::reload, a.stage);
        return name(ActionKind::backward, a.stage + 1) + " or " +
               name(ActionKind::input_grad, a.stage + 1);
      case ActionKind::weight_grad:
        return name(ActionKind::input_grad, a.stage);
      case ActionKind::recompute:
        if (away(a)) return name(ActionKind::reload, a.stage);
        return name(ActionKind::forward, a.stage);
      case ActionKind::offload:
        return name(ActionKind::forward, a.stage);
      case ActionKind::reload:
        return name(ActionKind::offload, a.stage);
    }
    return "?";
  }

 private:
  std::size_t cells() const { return static_cast<std::size_t>(n_) * static_cast<std::size_t>(m_); }
  std::size_t index(int stage, int micro) const {
    return static_cast<std::size_t>(stage) * static_cast<std::size_t>(m_) +
           static_cast<std::size_t>(micro);
  }

  // Whether cell `a`'s kept input was offloaded and has not been reloaded yet.
  bool away(const Action& a) const {
    const auto k = index(a.stage, a.micro);
    return offloaded_[k] >= 0.0 && reloaded_[k] < 0.0;
  }
  // An offloaded cell's R, B or I waits for its reload to land.
  template <class Need>
  bool back_on_device(const Action& a, Need& need) const {
    return offloaded_[index(a.stage, a.micro)] < 0.0 || need(reloaded_, a.stage);
  }

  int n_;
  int m_;
  std::vector<double> forward_;
  std::vector<double> grad_;   // B or I ended: the gradient for the previous stage exists
  std::vector<double> input_;  // I ended: W may run
  std::vector<double> offloaded_;  // O ended: the kept input is on the host
  std::vector<double> reloaded_;   // L ended: it is back on the device
};

template <class Cost>
Replay replay(const std::vector<std::vector<Action>>& programs, Dependencies& deps, Cost&& cost) {
  Replay out;
  const std::size_t workers = programs.size();
  out.next.assign(workers, 0);
  std::vector<double> clock(workers, 0.0);
  std::vector<double> to_host(workers, 0.0);    // copy lane: device to host (O)
  std::vector<double> to_device(workers, 0.0);  // copy lane: host to device (L)
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t w = 0; w < workers; ++w) {
      auto& next = out.next[w];
      while (next < programs[w].size()) {
        const Action& a = programs[w][next];
        const auto ready = deps.ready(a);
        if (!ready) break;
        if (is_copy(a.kind)) {
          // Issued now, in program order; it runs once its lane is free.
          auto& lane = a.kind == ActionKind::offload ? to_host[w] : to_device[w];
          const double start = std::max({clock[w], lane, *ready});
          const double end = start + cost(a);
          deps.finish(a, end);
          out.timed.push_back({a, static_cast<int>(w), start, end, start - clock[w]});
          lane = end;
          ++next;
          progress = true;
          continue;
        }
        const double start = std::max(clock[w], *ready);
        const double end = start + cost(a);
        deps.finish(a, end);
        out.timed.push_back({a, static_cast<int>(w), start, end, start - clock[w]});
        clock[w] = end;
        ++next;
        progress = true;
      }
    }
  }
  for (std::size_t w = 0; w < workers; ++w) {
    if (out.next[w] < programs[w].size()) out.complete = false;
  }
  return out;
}

}  // namespace stagewise::schedule::detail
