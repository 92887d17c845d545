#pragma once

#include "stagewise/runtime/message.hpp"
#include "stagewise/schedule/comms.hpp"

#include <cstddef>
#include <string>
#include <vector>

namespace stagewise::runtime {

namespace detail {

inline std::string describe(const MessageKey& k) {
  const char* what = k.kind == MessageKind::activation ? "the activation"
                     : k.kind == MessageKind::gradient ? "the gradient"
                     : k.kind == MessageKind::skip     ? "skip"
                                                       : "the gradient of skip";
  const bool skip = k.kind == MessageKind::skip || k.kind == MessageKind::skip_grad;
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
    MessageKind kind = MessageKind::activation;
    switch (t.kind) {
      case schedule::TransferKind::activation:
        kind = MessageKind::activation;
        break;
      case schedule::TransferKind::gradient:
        kind = MessageKind::gradient;
        break;
      case schedule::TransferKind::skip:
        kind = MessageKind::skip;
        break;
      case schedule::TransferKind::skip_grad:
        kind = MessageKind::skip_grad;
        break;
    }
    keys.push_back(MessageKey{kind, t.to, t.micro, t.skip});
  }
  return keys;
}

}  // namespace stagewise::runtime
