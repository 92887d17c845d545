#pragma once

#include "stagewise/runtime/message.hpp"
#include "stagewise/schedule/comms.hpp"

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace stagewise::runtime {

namespace detail {

// A value of the step shared by `C10dTransport::share` travels under a key of its own: stage -1,
// micro-batch = the value's index (0: the number of micro-batches, 1: the loss, 2: a rank's word
// that it finished the step, `C10dTransport::end_step`).
inline MessageKey step_value_key(int index) {
  return MessageKey{schedule::TransferKind::activation, -1, index};
}
inline constexpr int kStepDoneIndex = 2;

inline std::string describe(const MessageKey& k) {
  if (k.stage < 0) {
    return k.micro == 0   ? "the step's number of micro-batches"
           : k.micro == 1 ? "the step's loss"
                          : "its word that it finished the step";
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

// The Gloo tag of message `k` in step `step`, 29 bits: step % 4, kind, receiving stage,
// micro-batch, skip + 1 (so keys cannot mix across consecutive steps). Checked: 256 stages, 4096
// micro-batches and 31 skips at most.
inline int message_tag(const MessageKey& k, std::int64_t step) {
  TORCH_CHECK(k.stage >= 0 && k.stage < 256 && k.micro >= 0 && k.micro < 4096 && k.skip >= -1 &&
                  k.skip < 31,
              "stagewise::C10dTransport: ", describe(k),
              " is beyond what message tags hold (256 stages, 4096 micro-batches, 31 skips); "
              "use fewer chunks or stages");
  const int step_kind = static_cast<int>(step % 4) * 4 + schedule::index_of(k.kind);
  return (((step_kind * 256 + k.stage) * 4096 + k.micro) * 32) + (k.skip + 1);
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
