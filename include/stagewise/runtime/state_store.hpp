#pragma once

#include "stagewise/optim/state_offload.hpp"

#include <concepts>
#include <optional>
#include <string>
#include <utility>

namespace stagewise::runtime {

/// A store of optimizer state (what `runtime::OffloadedState` keeps off the device), per key (one
/// parameter's), changed a step at a time: `read_state(key)` gives the state kept for `key`
/// (none: not yet) as tensors on the host that the caller may change; `write_state(key,
/// record)` stages its new state (an empty record: none), kept only by `commit_state()`, which
/// makes every staged state the kept one, or dropped by `discard_state()`, which leaves every
/// kept state as it was. A failure names the store and the fix. Writes and reads of different
/// keys may run at once on different threads; `commit_state` and `discard_state` run alone.
/// Models: `HostStore` (host memory), `FileStore` (a file per key, written anew and renamed over
/// the old one on commit); a store that models `offload_store` too may hold a pipe's activations
/// beside it (`AnyStore` holds either).
///   static_assert(stagewise::runtime::state_store<MyStore>);
template <class S>
concept state_store = requires(S& s, const std::string& key, optim::StateRecord record) {
  { s.read_state(key) } -> std::same_as<std::optional<optim::StateRecord>>;
  s.write_state(key, std::move(record));
  s.commit_state();
  s.discard_state();
  { s.describe() } -> std::convertible_to<std::string>;
};

}  // namespace stagewise::runtime
