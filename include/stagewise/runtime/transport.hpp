#pragma once

#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/processes.hpp"
#include "stagewise/schedule/comms.hpp"
#include "stagewise/schedule/plan.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// Moves messages between stages. send never blocks on the receiver; recv blocks until the
/// message for `key` is there, or returns std::nullopt once the step was aborted. abort(e) wakes
/// every receiver for good (the first `e` is the step's error). `MailboxTransport` is the
/// in-process one; a transport between processes (c10d) satisfies the same concept. This is what
/// the executor (`run_programs`) asks; a pipe asks for a `pipe_transport`.
///   static_assert(stagewise::runtime::transport<stagewise::runtime::MailboxTransport>);
template <class T>
concept transport = requires(T& t, const MessageKey& k, Message m, std::exception_ptr e) {
  t.send(k, std::move(m));
  { t.recv(k) } -> std::same_as<std::optional<Message>>;
  t.abort(e);
};

/// An error raised in another process and relayed here by a transport ("rank K failed: ..."):
/// it names the cell where it was raised, so the executor does not add this process's cell.
struct RelayedError : c10::Error {
  explicit RelayedError(const c10::Error& e) : c10::Error(e) {}
};

/// What a transport moved out of this process and into it: messages and the bytes of their
/// tensors' data. Message headers (a few dozen bytes each) are not counted, nor are messages
/// between stages of the same process, which move no bytes (so an in-process transport counts 0).
///   auto t = pipe->traffic();  // distributed::Pipe, cumulative since it was built
///   std::printf("%lld bytes sent in %lld messages\n", (long long)t.bytes_sent,
///               (long long)t.messages_sent);
struct Traffic {
  std::int64_t messages_sent = 0;
  std::int64_t bytes_sent = 0;
  std::int64_t messages_received = 0;
  std::int64_t bytes_received = 0;
};

/// Everything a pipe asks of its transport. `stagewise::PipeOver<T>` is the pipe over any type
/// that satisfies it (`stagewise::Pipe` is it over `MailboxTransport`, `distributed::Pipe` over
/// `C10dTransport`); it asks nothing else, so a new transport is one header and one alias
/// (docs/distributed.md, "A transport of your own"):
/// - the messages of the step (`transport`); between processes, `recv` returns nothing only once
///   this process aborted, and throws an error naming the other process once that one failed;
/// - `processes()`: which processes exist and which stages each runs (`Processes`); the pipe
///   keeps the stages of this process and refuses a schedule that places them otherwise;
/// - `gather(what, mine)`: every process's `mine` in rank order, once every process has given
///   its own (every process makes the same calls in the same order; `what` names the call in
///   errors, e.g. "Pipe::load"); one process: `{mine}`. Saves and loads agree through it;
/// - `begin_step(plan, routes)` on the caller's thread before any worker runs: the step's plan,
///   already verified, and its skip routes (skip i's messages carry index i); a transport between
///   processes checks the plan's messages can flow (`schedule::verify_comms`) and may post its
///   receives now;
/// - `share(value, from, index)`: every process gets the small tensor that worker (process)
///   `from` holds (index 0: the number of micro-batches, from the first stage's; 1: the loss,
///   from the last stage's); undefined once this process aborted. Every process makes the same
///   calls in the same order; in one process it returns `value`;
/// - `end_step()`, after the loss: returns once every process finished the step's work, and
///   throws the failure of one that did not, so that no process returns from a step (and runs
///   its optimizer) that failed elsewhere; in one process it returns at once;
/// - `error()`: the step's first error given to `abort` (null if none), read after the step;
/// - `traffic()`: what crossed processes so far.
/// A type missing one of these is refused at compile time, naming the expression. One more call
/// is optional (`value_gathering_transport`): `gather_values`, which a clipped step uses.
///   static_assert(stagewise::runtime::pipe_transport<stagewise::runtime::MailboxTransport>);
template <class T>
concept pipe_transport = transport<T> && requires(T& t, const T& ct, const schedule::Plan& plan,
                                                  const std::vector<schedule::SkipRoute>& routes,
                                                  const torch::Tensor& value, int from, int index,
                                                  const std::string& text) {
  { ct.processes() } -> std::convertible_to<Processes>;
  { t.gather(text, text) } -> std::same_as<std::vector<std::string>>;
  t.begin_step(plan, routes);
  { t.share(value, from, index) } -> std::same_as<torch::Tensor>;
  t.end_step();
  { ct.error() } -> std::same_as<std::exception_ptr>;
  { ct.traffic() } -> std::same_as<Traffic>;
};

/// A `pipe_transport` that also gathers numbers on its own: `gather_values(what, values)` returns
/// every process's `values` (a 1-D float64 tensor on the CPU, whose length may differ between
/// processes) in rank order, exactly, once every process has given its own (every process makes
/// the same calls in the same order, between steps; `what` names the call in errors); one
/// process: `{values}`. A clipped step (`pipe->clip_grad_norm_step`) gathers the gradient norms
/// with it, once per step: `C10dTransport` over the process group (an all-gather), not the store.
/// Optional: without it, the pipe sends the numbers through `gather` as exact text
/// (`gather_values_as_text`).
///   static_assert(stagewise::runtime::value_gathering_transport<stagewise::runtime::C10dTransport>);
template <class T>
concept value_gathering_transport =
    pipe_transport<T> && requires(T& t, const std::string& what, const torch::Tensor& values) {
  { t.gather_values(what, values) } -> std::same_as<std::vector<torch::Tensor>>;
};

/// `gather_values` through a transport's text `gather`: each number written exactly ("%a", read
/// back with strtod), so every process gets the same doubles, bit for bit.
///   auto all = stagewise::runtime::gather_values_as_text(t, "my exchange", torch::tensor({1.5}));
template <pipe_transport T>
std::vector<torch::Tensor> gather_values_as_text(T& t, const std::string& what,
                                                 const torch::Tensor& values) {
  const auto mine = values.to(torch::kCPU, torch::kDouble).contiguous();
  std::string text;
  char buf[64];
  for (std::int64_t i = 0; i < mine.numel(); ++i) {
    std::snprintf(buf, sizeof buf, "%a ", mine.data_ptr<double>()[i]);
    text += buf;
  }
  std::vector<torch::Tensor> out;
  for (const auto& theirs : t.gather(what, text)) {
    std::vector<double> v;
    for (const char* p = theirs.c_str(); *p != '\0';) {
      char* end = nullptr;
      const double d = std::strtod(p, &end);
      if (end == p) break;
      v.push_back(d);
      p = end;
    }
    out.push_back(torch::tensor(v, torch::kDouble));
  }
  return out;
}

/// Every process's `values` as `value_gathering_transport` says: through the transport's own
/// `gather_values` where it has one, else through its `gather` as text.
template <pipe_transport T>
std::vector<torch::Tensor> gather_values(T& t, const std::string& what,
                                         const torch::Tensor& values) {
  if constexpr (value_gathering_transport<T>) {
    return t.gather_values(what, values);
  } else {
    return gather_values_as_text(t, what, values);
  }
}

}  // namespace stagewise::runtime
