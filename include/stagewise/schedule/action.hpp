#pragma once

#include <ostream>
#include <string>

namespace stagewise::schedule {

/// What a stage does in one step of a schedule.
enum class ActionKind : char {
  forward = 'F',      ///< run the stage on a micro-batch
  backward = 'B',     ///< full backward of a cell (input and weight gradients)
  input_grad = 'I',   ///< backward to the cell's inputs only (zero-bubble)
  weight_grad = 'W',  ///< the weight gradients left by an earlier input_grad
  recompute = 'R',    ///< re-run a checkpointed forward with grad, just before its backward
  offload = 'O',      ///< move what a checkpointed cell keeps to a host store (after its F)
  reload = 'L',       ///< load it back onto the device, before the cell's R ('R' is recompute)
};

/// Whether `k` is a copy (offload O or reload L): copies run beside the compute, on copy streams
/// of their own, so the simulator puts them on a worker's copy lanes and not on its clock.
constexpr bool is_copy(ActionKind k) {
  return k == ActionKind::offload || k == ActionKind::reload;
}

/// One action of a schedule: stage `stage` does `kind` for micro-batch `micro`.
///   stagewise::schedule::Action{0, ActionKind::forward, 3}  // printed as "F3@0"
struct Action {
  int stage = 0;
  ActionKind kind = ActionKind::forward;
  int micro = 0;
  friend bool operator==(const Action&, const Action&) = default;
};

inline std::string to_string(const Action& a) {
  return std::string(1, static_cast<char>(a.kind)) + std::to_string(a.micro) + "@" +
         std::to_string(a.stage);
}

inline std::ostream& operator<<(std::ostream& os, const Action& a) { return os << to_string(a); }

/// A cell of the pipeline grid: micro-batch `micro` on stage `stage`.
struct Cell {
  int micro = 0;
  int stage = 0;
  friend bool operator==(const Cell&, const Cell&) = default;
};

/// Printed as "(micro 2, stage 1)", so that test frameworks and loggers can show cells (and
/// vectors of them, once glog's stl_logging.h, which LibTorch may include, is in scope).
inline std::ostream& operator<<(std::ostream& os, const Cell& c) {
  return os << "(micro " << c.micro << ", stage " << c.stage << ")";
}

}  // namespace stagewise::schedule
