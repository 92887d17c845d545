#pragma once

#include "stagewise/runtime/message.hpp"
#include "stagewise/schedule/comms.hpp"

#include <cstddef>
#include <string>
#include <vector>

namespace stagewise::runtime {

namespace detail {

// A value of the step shared by `C10dTransport::share` travels under a key of its own: stage -1,
// micro-batch = the value's index (0: the number of micro-batches, 1: the loss).
inline MessageKey step_value_key(int index) {
  return MessageKey{schedule::TransferKind::activation, -1, index};
}

inline std::string describe(const MessageKey& k) {
  if (k.stage < 0) {
    return k.micro == 0 ? "the step's number of micro-batches" : "the step's loss";
  }
  const char* what = k.kind == schedule::TransferKind::activation ? "the activation"
                     : k.kind == schedule::TransferKind::gradient ? "the gradient"
                     : k.kind == schedule::TransferKind::skip     ? "skip"
                                                                  : "the gradient of skip";
  const bool skip =
      k.kind == schedule::TransferKind::skip || k.kind == schedule::TransferKind::skip_grad;
  return std::string(what) + (skip ? " " + std::to_string(k.skip) : "") + " of micro-batch " +
         std::to_string(k.micro) + " for stage " + std::to_string(k.stage);
}

}  // namespace detail

/// The messages worker `w` receives from other workers in a step, in the order it receives
/// them: what `C10dTransport::expect` posts ahead.
///   t.expect(receives_of(schedule::comms(plan, routes), t.rank()));
inline std::vector<MessageKey> receives_of(const schedule::CommPlan& c, int w) {
  std::vector<MessageKey> keys;
  for (const auto& step : c.programs.at(static_cast<std::size_t>(w))) {
    const auto& t = step.transfer;
    if (step.send || c.worker_of(t.from) == w) continue;
    keys.push_back(MessageKey{t.kind, t.to, t.micro, t.skip});
  }
  return keys;
}

}  // namespace stagewise::runtime
