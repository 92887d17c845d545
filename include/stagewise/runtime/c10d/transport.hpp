#pragma once

#include "stagewise/core/error_context.hpp"
#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/detail/failure_watch.hpp"
#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/detail/link.hpp"
#include "stagewise/runtime/c10d/detail/receiver.hpp"
#include "stagewise/runtime/c10d/detail/sender.hpp"
#include "stagewise/runtime/c10d/gather_text.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/keys.hpp"
#include "stagewise/runtime/c10d/options.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"
#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/processes.hpp"
#include "stagewise/runtime/stream.hpp"
#include "stagewise/runtime/transport.hpp"
#include "stagewise/schedule/comms.hpp"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// Moves messages between the stages of a pipeline whose stages live in several processes:
/// to a stage of this process through the step's MailboxTransport, to another rank over c10d
/// point-to-point. A message to another rank is a header (number of tensors, atomic flag, and
/// per tensor: defined?, dtype, shape, and for a tensor sent on its own its size and last bytes)
/// followed by one send per non-empty tensor, all under one tag derived from the key and the
/// step, so receivers need no shapes in advance and keys cannot mix across steps. Each transfer
/// is checked on arrival against its header, and a gradient against the activation it answers
/// (detail/header.hpp, detail/arrival.hpp); ranks compare their wire formats at start-up
/// (`check_same_wire`, which distributed::Pipe runs).
///
/// It is three parts, each with its own state and lock: a sender (detail/sender.hpp), a receiver
/// (detail/receiver.hpp) and a failure watch (detail/failure_watch.hpp), which stops the other
/// two and the step's in-process mailbox when the job fails.
///
/// Failures end the whole job, boundedly: a rank that calls `abort(e)` writes its error to the
/// store, where every other rank looks every `poll`; a rank whose connection closes (killed,
/// crashed) is named by the ranks that talk to it, which write that to the store too; a
/// receive that waits longer than `timeout` fails on its rank and then on all. `recv` then
/// throws c10::Error naming the failed rank; after this process's own `abort` it returns
/// nothing.
///   auto c = stagewise::runtime::connect(stagewise::runtime::rendezvous_env());
///   stagewise::runtime::C10dTransport t(c, std::vector<int>{0, 1, 0, 1});  // stage j on j % 2
///   t.begin_step(2, 8, 0);
///   t.send({schedule::TransferKind::activation, 1, 0}, {{x}});  // to stage 1, on rank 1
class C10dTransport {
 public:
  /// The transport of a pipe whose stage j runs on rank `placement[j]` of `c`'s group (the
  /// plan's `worker_of`), as `processes()` tells the pipe (`stagewise::PipeOver`).
  C10dTransport(const Connection& c, std::vector<int> placement, C10dOptions options = {})
      : C10dTransport(
            c, [placement](int stage) { return placement.at(static_cast<std::size_t>(stage)); }, {},
            std::move(options)) {
    placement_ = std::move(placement);
    for (const int r : placement_) {
      TORCH_CHECK(r >= 0 && r < link_.group.size(),
                  "stagewise::C10dTransport: a stage is placed on ", "rank ", r, " of a group of ",
                  link_.group.size(),
                  "; place every stage on a rank of "
                  "the group");
    }
  }

  /// Messages alone, without a pipe: `rank_of(stage)` places stages on ranks; `routes[i]` is
  /// skip i's stash and pop stage, so that a skip's receiver knows where it comes from
  /// (begin_step(plan, routes) replaces them).
  C10dTransport(const Connection& c, std::function<int(int)> rank_of,
                std::vector<schedule::SkipRoute> routes = {}, C10dOptions options = {})
      : options_(std::move(options)),
        connection_(c),
        link_(c),
        watch_(c, options_, link_),
        sender_(link_, watch_),
        receiver_(link_, watch_, options_),
        rank_of_(std::move(rank_of)),
        routes_(std::move(routes)) {
    // A failure, an abort here or closing stops the sender and the receiver; a failure or an
    // abort also fails the step's mailbox with its error.
    watch_.start([this] { return receiver_.overdue(); },
                 [this](const std::exception_ptr& cause) {
                   sender_.stop();
                   receiver_.stop();
                   if (cause) abort_local(cause);
                 });
    sender_.start();
    receiver_.start();
  }

  C10dTransport(const C10dTransport&) = delete;
  C10dTransport& operator=(const C10dTransport&) = delete;

  /// Waits (at most `timeout`) for this rank's sends to be received, then stops. After a failure,
  /// the rank that serves the store first waits (boundedly) for the others to read its cause.
  ~C10dTransport() {
    if (watch_.failed_or_aborted()) watch_.linger();
    sender_.drain(options_.timeout());
    watch_.close();  // stops the sender and the receiver too
    sender_.close();
    receiver_.close();
  }

  /// This process's rank.
  int rank() const { return link_.rank(); }

  /// The job's ranks and the job rank of every stage (a pipe keeps this rank's stages). Only a
  /// transport built with every stage's placement knows them.
  Processes processes() const {
    TORCH_CHECK(!placement_.empty(),
                "stagewise::C10dTransport::processes: this transport was "
                "built with a rank_of function, which does not say how many stages there are; "
                "build it with every stage's rank (a std::vector<int>) to run a pipe over it");
    Processes p{link_.job_rank(rank()), connection_.job_world(), {}};
    for (const int r : placement_) p.stage.push_back(link_.job_rank(r));
    return p;
  }

  /// Every rank's `mine` (every rank of the job, in job-rank order), through the job's store
  /// (`gather_text`, which deletes its keys once all have read them); every rank makes the same
  /// calls in the same order. `what` names the call in errors. Saves and loads agree with it.
  std::vector<std::string> gather(const std::string& what, const std::string& mine) {
    return gather_text(connection_, options_.prefix() + "/gather/" + std::to_string(++gathers_),
                       mine, options_.timeout(), what);
  }

  /// Every rank's `values` (a 1-D float64 tensor of any length; every rank of the job, in job-rank
  /// order), exactly, over the job's process group (`Connection::across_job`; one all-gather once
  /// the lengths are known, `all_gather_values`), not the store: what a clipped step exchanges.
  /// Failures as for `wait_collective`. Every rank makes the same calls in the same order, between
  /// steps. Over a connection built without collectives it goes through `gather` as text.
  ///   auto all = t.gather_values("my exchange", torch::tensor({1.5}, torch::kDouble));
  std::vector<torch::Tensor> gather_values(const std::string& what, const torch::Tensor& values) {
    const auto& job = connection_.across_job();
    if (!job) return gather_values_as_text(*this, what, values);
    std::vector<int> members(static_cast<std::size_t>(job.size()));
    std::iota(members.begin(), members.end(), 0);
    // On the transport's own group (the job's), started under the lock of its sends and receives.
    const auto waited_for = what + " (every rank must call it)";
    return all_gather_values(
        job, values, options_.device(),
        [&](const c10::intrusive_ptr<c10d::Work>& work) {
          wait_collective(work, members, waited_for);
        },
        value_room_, connection_.job_ranks.empty() ? &link_.post : nullptr);
  }

  /// The messages and tensor bytes this rank sent to and received from other ranks since the
  /// transport was built (each message counted once it is sent, or once it has fully arrived).
  Traffic traffic() const {
    return {messages_sent_.load(), bytes_sent_.load(), receiver_.messages_received(),
            receiver_.bytes_received()};
  }

  /// Starts a training step of `plan` (a `pipe_transport`'s begin_step): checks that the plan's
  /// messages between ranks cannot deadlock (`schedule::verify_comms`), takes the step's skip
  /// routes, begins the step (below) and posts this rank's receives (`expect`). The check and
  /// the receives are worked out once for a plan and its routes, and reused while later steps
  /// run the same ones.
  void begin_step(const schedule::Plan& plan, const std::vector<schedule::SkipRoute>& routes) {
    if (!verified_ || routes != routes_ || !(plan == *verified_)) {
      verified_.reset();
      schedule::verify_comms(plan, routes);
      routes_ = routes;
      receives_ = receives_of(schedule::comms(plan, routes), rank());
      verified_ = plan;
    }
    begin_step(plan.stages, plan.micro_batches, static_cast<int>(routes.size()));
    expect(receives_);
  }

  /// Starts a training step of `stages` stages, `micro_batches` micro-batches and `skips` skip
  /// routes: messages of different steps never match, and messages between stages of this
  /// process go through a MailboxTransport made for the step. Call it on every rank, before
  /// each step.
  void begin_step(int stages, int micro_batches, int skips) {
    if (begun_) ++step_;
    begun_ = true;
    auto local = std::make_unique<MailboxTransport>(stages, micro_batches, skips);
    receiver_.begin_step();
    // Under the mailbox's lock: a failure that stops the transport now aborts this mailbox,
    // either here or in abort_local.
    std::lock_guard<std::mutex> lock(local_mutex_);
    if (watch_.stopped()) local->abort(watch_.failure());
    local_ = std::move(local);
  }

  /// Posts the receives of this step's messages from other ranks now, in the order this rank
  /// will ask for them (`keys`, as `schedule::comms` derives them from the verified plan; keys
  /// from this rank's own stages are left to the local mailbox). A background thread completes
  /// each as its sender sends it, so a message travels while this rank computes, and `recv(k)`
  /// takes it from there. The order must be the plan's: it is the order proved deadlock-free.
  /// On a CPU transport only (Gloo); elsewhere receives are posted when `recv` is called.
  ///   t.begin_step(2, 8, 0);
  ///   using stagewise::schedule::TransferKind;
  ///   t.expect({{TransferKind::activation, 1, 0}, {TransferKind::gradient, 0, 0}});
  void expect(const std::vector<MessageKey>& keys) {
    if (!options_.device().is_cpu()) return;
    watch_.rethrow_failure();
    if (watch_.stopped()) return;  // aborted here: nothing more is received
    for (const auto& k : keys) {
      const int from = source_stage(k);
      TORCH_CHECK(from >= 0, "stagewise::C10dTransport::expect: ", detail::describe(k),
                  " has no sending stage (stage 0 receives no activation)");
      const int src = rank_of_(from);
      if (src == rank()) continue;
      if (!receiver_.expect(k, src, tag_of(k))) return;  // aborted here
    }
  }

  /// Sends `m` to stage `k.stage`; returns once the sends are started (never waits for the
  /// receiver). After a failure elsewhere it throws that failure.
  void send(const MessageKey& k, Message m) {
    const int dst = rank_of_(k.stage);
    if (dst == rank()) {
      local().send(k, std::move(m));
      return;
    }
    send_to(dst, tag_of(k), k, std::move(m));
  }

  /// Waits for the message `k`; nothing once this process aborted; throws c10::Error naming the
  /// failed rank when another rank failed, died or stalled past the timeout.
  std::optional<Message> recv(const MessageKey& k) {
    const int src = rank_of_(source_stage(k));
    if (src == rank()) return local().recv(k);
    bool expected = false;
    auto ahead = receiver_.take_ahead(k, src, expected);
    if (expected) return ahead;
    return receiver_.receive_message(src, tag_of(k), k);
  }

  /// Gives every rank a small value of the step that one rank holds: `index` 0 is the number of
  /// micro-batches (from the first stage's rank), 1 the loss (from the last stage's). Rank `from`
  /// passes `value` and gets it back; every other rank gets `from`'s, on the CPU, sent over the
  /// process group like the step's messages (not through the store). Every rank makes the same
  /// calls in the same order. Failures as for recv; nothing (an undefined tensor) once this
  /// process aborted.
  ///   const int m = t.share(torch::tensor(8), /*from=*/0, 0).item<int>();
  torch::Tensor share(const torch::Tensor& value, int from, int index) {
    const MessageKey k = detail::step_value_key(index);
    const int tag = kValueTags + static_cast<int>(shared_++ % kValueTagCount);
    if (from == rank()) {
      TORCH_CHECK(value.defined(), "stagewise::C10dTransport::share: rank ", link_.job_rank(rank()),
                  " holds ", detail::describe(k), " but passed an undefined tensor");
      for (int r = 0; r < link_.group.size(); ++r) {
        if (r != rank()) send_to(r, tag, k, Message{{value.detach()}, true}, /*counted=*/false);
      }
      return value;
    }
    auto m = receiver_.receive_message(from, tag, k, /*counted=*/false);
    if (!m) return {};
    TORCH_CHECK(m->tensors.size() == 1 && m->tensors[0].defined(),
                "stagewise: ", detail::describe(k), " from rank ", link_.job_rank(from),
                " is garbled; every rank must run the same program");
    return copy_to(m->tensors[0], torch::kCPU);
  }

  /// The first error this process gave `abort` in the current step (null if none).
  std::exception_ptr error() const {
    std::lock_guard<std::mutex> lock(local_mutex_);
    return local_ ? local_->error() : nullptr;
  }

  /// Every rank tells every other that it finished the step's work (a header-only message under
  /// the shared values' tags, uncounted in traffic()) and waits to hear the same from each:
  /// returns once every rank finished; when one failed, its word never comes and its failure
  /// arrives as for recv (c10::Error naming the rank, its error and its cell). Every rank calls
  /// it after the step's loss.
  void end_step() {
    const MessageKey k = detail::step_value_key(detail::kStepDoneIndex);
    const int tag = kValueTags + static_cast<int>(shared_++ % kValueTagCount);
    for (int r = 0; r < link_.group.size(); ++r) {
      if (r != rank()) send_to(r, tag, k, Message{{}, true}, /*counted=*/false);
    }
    for (int r = 0; r < link_.group.size(); ++r) {
      if (r == rank()) continue;
      TORCH_CHECK(receiver_.receive_message(r, tag, k, /*counted=*/false).has_value(),
                  "stagewise::C10dTransport::end_step: rank ", link_.job_rank(rank()),
                  " aborted before the step ended");
    }
  }

  /// Waits for `work`, a collective this rank started with other ranks of the job on another
  /// process group (`members`: their job ranks, this one's included; `what` names the collective
  /// in errors, e.g. "the gradient reduction of stage 1"), failing as `recv` does: when any rank
  /// of the job failed (its cause), when a member's connection closed (the cause it published,
  /// else that it is gone), or past the timeout; every rank of the job then learns the cause.
  /// Throws c10::Error once this process aborted.
  ///   auto work = collectives.all_reduce_sum(tensors);
  ///   transport.wait_collective(work, {1, 3}, "the loss's all-reduce");
  void wait_collective(const c10::intrusive_ptr<c10d::Work>& work, const std::vector<int>& members,
                       const std::string& what) {
    const int me = link_.job_rank(rank());
    std::vector<int> others;
    for (const int r : members) {
      if (r != me) others.push_back(r);
    }
    std::string names;
    for (std::size_t k = 0; k < others.size(); ++k) {
      names += (k == 0 ? "" : k + 1 == others.size() ? " or " : ", ") + std::to_string(others[k]);
    }
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout();
    auto pause = std::chrono::microseconds(20);
    while (!work->isCompleted()) {
      watch_.rethrow_failure();
      TORCH_CHECK(!watch_.aborted_here(), "stagewise::C10dTransport::wait_collective: rank ", me,
                  " aborted while waiting for ", what);
      if (std::chrono::steady_clock::now() > deadline) {
        watch_.publish_and_fail("rank " + std::to_string(me) + " waited more than " +
                                std::to_string(options_.timeout().count()) + " ms for " + what +
                                " with rank" + (others.size() == 1 ? " " : "s ") + names +
                                "; that rank is stuck or slower than the timeout (raise "
                                "C10dOptions::timeout if it is just slow)");
        watch_.rethrow_failure();
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    try {
      work->wait();
    } catch (const std::exception& e) {
      watch_.rethrow_failure();
      watch_.rethrow_published_soon();  // a member that failed said why before it exited
      if (others.size() == 1) watch_.acknowledge_job_rank(others.front());  // never read
      watch_.publish_and_fail((others.size() == 1 ? "rank " : "one of ranks ") + names +
                              " is gone: its connection closed while rank " + std::to_string(me) +
                              " waited for " + what +
                              " with it; it crashed, was killed, or exited early (see its output). "
                              "Transport error: " +
                              detail::what_of(e));
      watch_.rethrow_failure();
      throw;
    }
  }

  /// Stops this rank's communication after a failure here: tells every other rank through the
  /// store (they fail with `e`'s message and, whatever its type, the cell it came from, naming
  /// this rank), wakes this process's receivers (they return nothing) and cancels pending
  /// transfers. On the rank that serves the store it then waits, boundedly, until the others
  /// have read the cause.
  void abort(std::exception_ptr e) { watch_.abort_here(e); }

 private:
  // Tags at and above 2^29 are the shared values' (message tags stay below, see tag_of); they
  // cycle through kValueTagCount, which every rank steps through in the same order.
  static constexpr int kValueTags = 1 << 29;
  static constexpr std::int64_t kValueTagCount = 1024;

  // Sends `m` to rank `dst` under `tag`: a header, then one send per non-empty tensor, or all in
  // one transfer where they fit its inline room (detail/header.hpp). `counted`: in traffic() (the
  // step's messages are; the shared values are not).
  void send_to(int dst, int tag, const MessageKey& k, Message m, bool counted = true) {
    watch_.throw_if_failed();
    if (watch_.stopped()) return;  // this rank aborted: nobody waits for it any more
    // Before it leaves: its gradient cannot come back earlier.
    if (auto reply = reply_to(k)) receiver_.replies().expect(*reply, k, m);
    // Onto the transport's device through the one crossing helper (this is the sending stage's
    // worker: its current stream is the stage's compute stream).
    const auto out = detail::transfers_of(m, options_.device(), receiver_.inline_room());
    if (!sender_.send(dst, tag, k, out)) return;  // aborted here
    if (counted) {
      ++messages_sent_;
      bytes_sent_ += detail::payload_bytes(m);
    }
  }

  // A failure or an abort fails the step's mailbox (between this rank's own stages) with it.
  void abort_local(const std::exception_ptr& cause) {
    std::lock_guard<std::mutex> lock(local_mutex_);
    if (local_) local_->abort(cause);
  }

  MailboxTransport& local() {
    std::lock_guard<std::mutex> lock(local_mutex_);
    TORCH_CHECK(local_ != nullptr, "stagewise::C10dTransport: call begin_step(stages, ",
                "micro_batches, skips) before a step's messages");
    return *local_;
  }

  int source_stage(const MessageKey& k) const {
    switch (k.kind) {
      case schedule::TransferKind::activation:
        return k.stage - 1;
      case schedule::TransferKind::gradient:
        return k.stage + 1;
      case schedule::TransferKind::skip:
      case schedule::TransferKind::skip_grad:
        TORCH_CHECK(k.skip >= 0 && static_cast<std::size_t>(k.skip) < routes_.size(),
                    "stagewise::C10dTransport: skip ", k.skip, " has no route; pass every skip's ",
                    "(stash stage, pop stage) to the transport, ", routes_.size(), " were given");
        return k.kind == schedule::TransferKind::skip
                   ? routes_[static_cast<std::size_t>(k.skip)].stash_stage
                   : routes_[static_cast<std::size_t>(k.skip)].pop_stage;
    }
    return k.stage;
  }

  // The gradient that answers message `k` (an activation or a skip), which this rank will receive.
  std::optional<MessageKey> reply_to(const MessageKey& k) const {
    using schedule::TransferKind;
    if (k.stage < 0) return std::nullopt;  // a shared value
    if (k.kind == TransferKind::activation) {
      return MessageKey{TransferKind::gradient, k.stage - 1, k.micro};
    }
    if (k.kind == TransferKind::skip && k.skip >= 0 &&
        static_cast<std::size_t>(k.skip) < routes_.size()) {
      return MessageKey{TransferKind::skip_grad,
                        routes_[static_cast<std::size_t>(k.skip)].stash_stage, k.micro, k.skip};
    }
    return std::nullopt;
  }

  int tag_of(const MessageKey& k) const { return detail::message_tag(k, step_.load()); }

  C10dOptions options_;
  Connection connection_;  // for gather
  detail::Link link_;      // the group, its post lock, the job ranks' names
  detail::FailureWatch watch_;
  detail::Sender sender_;
  detail::Receiver receiver_;
  std::atomic<std::int64_t> messages_sent_{0}, bytes_sent_{0};  // to other ranks
  mutable std::mutex local_mutex_;                              // local_
  std::unique_ptr<MailboxTransport> local_;  // this step's, between stages of this process
  std::vector<int> placement_;  // every stage's rank; empty: built with a rank_of function
  std::int64_t gathers_ = 0;    // gather calls so far
  std::int64_t value_room_ = 0;  // numbers per rank gather_values sends (all_gather_values)
  std::function<int(int)> rank_of_;
  std::vector<schedule::SkipRoute> routes_;
  std::optional<schedule::Plan> verified_;  // the last plan begin_step verified, with routes_
  std::vector<MessageKey> receives_;        // its receives on this rank
  std::atomic<std::int64_t> step_{0};
  std::int64_t shared_ = 0;  // share() calls so far
  bool begun_ = false;
};

}  // namespace stagewise::runtime
