#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace stagewise {

/// The part of a training step a pipeline cell was running.
enum class Phase {
  forward,      ///< the cell's forward (also a checkpointed cell's first, no-grad run)
  recompute,    ///< a checkpointed cell's second forward, before its backward
  backward,     ///< the cell's backward
  input_grad,   ///< zero-bubble's input-gradient half of the backward (I)
  weight_grad,  ///< zero-bubble's weight-gradient half of the backward (W)
  offload,      ///< moving a checkpointed cell's kept inputs to a host store (O)
  reload,       ///< loading them back from the store (L)
};

namespace detail {
// An exception's message without a c10::Error's backtrace (its what() adds one).
inline std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}
}  // namespace detail

/// The phase's name as error contexts print it ("forward", "input-gradient backward" ...).
inline const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::forward:
      return "forward";
    case Phase::recompute:
      return "recompute";
    case Phase::backward:
      return "backward";
    case Phase::input_grad:
      return "input-gradient backward";
    case Phase::weight_grad:
      return "weight-gradient backward";
    case Phase::offload:
      return "offload";
    case Phase::reload:
      return "reload";
  }
  return "unknown phase";
}

/// Where in a pipeline an exception was raised: the stage, the micro-batch and the phase.
///
/// A pipe records one for every exception that escapes a stage. The exception itself reaches the
/// caller with its own type and text; a `c10::Error` also carries the context in `what()` (after
/// its message, through c10's own `add_context`). Get it back with `stagewise::error_context`.
///   catch (const std::exception&) {
///     if (auto where = stagewise::error_context(std::current_exception()))
///       std::cerr << where->text() << "\n";  // "stagewise: stage 1, micro-batch 0, forward"
///   }
struct ErrorContext {
  int stage = 0;        ///< index of the stage in the pipe
  int micro_batch = 0;  ///< index of the micro-batch in the mini-batch
  Phase phase = Phase::forward;

  /// "stagewise: stage S, micro-batch M, PHASE", the text added to a `c10::Error`.
  std::string text() const {
    return "stagewise: stage " + std::to_string(stage) + ", micro-batch " +
           std::to_string(micro_batch) + ", " + to_string(phase);
  }
};

namespace detail {

// The contexts of the most recent annotated exceptions, newest last. Holding the exception_ptr
// keeps each object alive, so its address cannot be reused by another exception while listed.
struct ErrorRegistry {
  static constexpr std::size_t capacity = 32;
  std::mutex mutex;
  std::deque<std::pair<std::exception_ptr, ErrorContext>> entries;

  static ErrorRegistry& get() {
    static auto* r = new ErrorRegistry();  // leaked: workers may still fail during teardown
    return *r;
  }
};

// Records `where` for the exception being handled (inside a catch block) unless it already has
// a context (the innermost one wins: a recompute inside a backward names the recompute), and adds
// it to a c10::Error's context. The caller rethrows it unchanged with `throw;`.
inline void annotate_current_exception(const ErrorContext& where) {
  std::exception_ptr current = std::current_exception();
  if (!current) return;
  auto& registry = ErrorRegistry::get();
  {
    std::lock_guard<std::mutex> lock(registry.mutex);
    for (const auto& entry : registry.entries) {
      if (entry.first == current) return;
    }
    registry.entries.emplace_back(current, where);
    if (registry.entries.size() > ErrorRegistry::capacity) registry.entries.pop_front();
  }
  try {
    std::rethrow_exception(current);
  } catch (c10::Error& e) {
    e.add_context(where.text());  // the same object the caller will rethrow
  } catch (...) {
  }
}

}  // namespace detail

/// The context a pipe recorded for exception `e` (pass `std::current_exception()` in a catch
/// block), or nothing for an exception that did not come from a pipeline stage. Works for every
/// exception type; the most recent 32 failures are remembered.
///   try { pipe->train_step(x, y, loss_fn); }
///   catch (const MyError& e) { auto where = stagewise::error_context(std::current_exception()); }
inline std::optional<ErrorContext> error_context(const std::exception_ptr& e) {
  if (!e) return std::nullopt;
  auto& registry = detail::ErrorRegistry::get();
  std::lock_guard<std::mutex> lock(registry.mutex);
  for (auto it = registry.entries.rbegin(); it != registry.entries.rend(); ++it) {
    if (it->first == e) return it->second;
  }
  return std::nullopt;
}

}  // namespace stagewise
