#pragma once

#include <torch/types.h>

#include <concepts>
#include <cstdint>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// What a message between two stages carries.
enum class MessageKind : std::uint8_t { activation, gradient, skip, skip_grad };

/// Names one message of a training step: `kind` for micro-batch `micro`, addressed to the
/// receiving stage `stage`; `skip` is the skip's index for skip messages (-1 otherwise).
///   stagewise::runtime::MessageKey{MessageKind::activation, 1, 3}  // stage 1's input, micro 3
struct MessageKey {
  MessageKind kind;
  int stage;
  int micro;
  int skip = -1;
  friend bool operator==(const MessageKey&, const MessageKey&) = default;
};

/// The tensors of one message (elements may be undefined) and whether they were one tensor
/// rather than a tuple.
struct Message {
  std::vector<torch::Tensor> tensors;
  bool atomic = true;
};

/// A way to move messages between stage workers: `send` never waits for the receiver, `recv`
/// blocks until the message with that key arrives and returns nothing once the transport was
/// aborted; `abort(e)` wakes every receiver.
template <class T>
concept transport = requires(T& t, const MessageKey& k, Message m, std::exception_ptr e) {
  t.send(k, std::move(m));
  { t.recv(k) } -> std::same_as<std::optional<Message>>;
  t.abort(e);
};

}  // namespace stagewise::runtime
