#pragma once

#include "stagewise/schedule/transfer_kind.hpp"

#include <torch/types.h>

#include <cstddef>
#include <functional>
#include <vector>

namespace stagewise::runtime {

/// Identifies one message of a step: what it is, the stage that receives it, the micro-batch, and
/// for skip kinds the skip's index in the pipe's skip layout (-1 otherwise).
/// The kind is the schedule layer's `TransferKind`: a stage's output (activation), the gradient of
/// a stage's input (gradient), a skip connection's stashed tensor (skip) or its gradient
/// (skip_grad).
///   MessageKey{schedule::TransferKind::skip, /*stage=*/2, /*micro=*/0, /*skip=*/1}
struct MessageKey {
  schedule::TransferKind kind;
  int stage;
  int micro;
  int skip = -1;
  friend bool operator==(const MessageKey&, const MessageKey&) = default;
};

/// Hashes a MessageKey, for unordered containers keyed by message.
///   std::unordered_map<MessageKey, Message, MessageKeyHash> box;
struct MessageKeyHash {
  std::size_t operator()(const MessageKey& k) const noexcept {
    std::size_t h = static_cast<std::size_t>(k.kind);
    h = h * 1000003u ^ static_cast<std::size_t>(static_cast<unsigned>(k.stage));
    h = h * 1000003u ^ static_cast<std::size_t>(static_cast<unsigned>(k.micro));
    h = h * 1000003u ^ static_cast<std::size_t>(static_cast<unsigned>(k.skip));
    return h;
  }
};

/// What travels: tensors (an element may be undefined, e.g. a missing gradient) and whether the
/// batch is one tensor (atomic) or a tuple.
///   Message{{x.detach()}, /*atomic=*/true}
struct Message {
  std::vector<torch::Tensor> tensors;
  bool atomic = true;
};

}  // namespace stagewise::runtime

/// std::hash for MessageKey (the same as MessageKeyHash).
template <>
struct std::hash<stagewise::runtime::MessageKey> : stagewise::runtime::MessageKeyHash {};
