#pragma once

namespace stagewise::schedule {

/// What a message between two stages carries: the one name for it, used by the schedule layer's
/// communication plans (`Transfer`) and by the runtime's messages (`runtime::MessageKey`).
///   stagewise::runtime::MessageKey{stagewise::schedule::TransferKind::gradient, /*stage=*/0, 3}
enum class TransferKind : char {
  activation = 'a',  ///< a forward output, stage j to stage j+1
  gradient = 'g',    ///< the gradient of that output, stage j+1 back to stage j
  skip = 's',        ///< a skip tensor, stash stage to pop stage
  skip_grad = 'k',   ///< the gradient of a skip tensor, pop stage back to stash stage
};

/// The kind's position 0-3 (activation, gradient, skip, skip_grad), for tables and message tags.
constexpr int index_of(TransferKind kind) {
  switch (kind) {
    case TransferKind::activation:
      return 0;
    case TransferKind::gradient:
      return 1;
    case TransferKind::skip:
      return 2;
    case TransferKind::skip_grad:
      return 3;
  }
  return 0;
}

}  // namespace stagewise::schedule
