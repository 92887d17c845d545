#pragma once

#include "stagewise/runtime/message.hpp"

#include <concepts>
#include <exception>
#include <optional>
#include <utility>

namespace stagewise::runtime {

/// Moves messages between stages. send never blocks on the receiver; recv blocks until the
/// message for `key` is there, or returns std::nullopt once the step was aborted. abort(e) wakes
/// every receiver for good (the first `e` is the step's error). `MailboxTransport` is the
/// in-process one; a transport between processes (c10d) satisfies the same concept.
///   static_assert(stagewise::runtime::transport<stagewise::runtime::MailboxTransport>);
template <class T>
concept transport = requires(T& t, const MessageKey& k, Message m, std::exception_ptr e) {
  t.send(k, std::move(m));
  { t.recv(k) } -> std::same_as<std::optional<Message>>;
  t.abort(e);
};

}  // namespace stagewise::runtime
