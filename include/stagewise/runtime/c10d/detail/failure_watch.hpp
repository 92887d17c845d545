#pragma once

#include "stagewise/core/error_context.hpp"
#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/detail/link.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/keys.hpp"
#include "stagewise/runtime/c10d/options.hpp"
#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/transport.hpp"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// C10dTransport's failure state and how a failure spreads: to the store for the other ranks
// (published once; the first writer wins), and to this rank's sender, receiver and step mailbox
// (the `on_stop` listeners, called once, outside this lock, when the transport stops). Its
// watchdog thread looks for another rank's failure in the store once per poll, and asks the
// receiver (`overdue`) for a receive past its deadline. One lock guards its own state only.
class FailureWatch {
 public:
  // `overdue()`: what a receive waiting past its deadline waits for, if any (the receiver's).
  using Overdue = std::function<std::optional<std::string>()>;
  using OnStop = std::function<void(const std::exception_ptr&)>;

  FailureWatch(const Connection& c, const C10dOptions& options, const Link& link)
      : store_(c.store),
        options_(options),
        link_(link),
        abort_key_(options_.prefix() + "/abort"),
        seen_key_(options_.prefix() + "/abort_seen"),
        serves_store_(c.serves_store),
        job_size_(c.job_world()) {
    ignore_sigpipe();  // also for a connection the caller built (group.hpp)
  }
  ~FailureWatch() { close(); }

  FailureWatch(const FailureWatch&) = delete;
  FailureWatch& operator=(const FailureWatch&) = delete;

  // Starts the watchdog. `on_stop` is called once, with the cause (null when closing), when the
  // transport stops: a failure here or elsewhere, an abort here, or closing.
  void start(Overdue overdue, OnStop on_stop) {
    overdue_ = std::move(overdue);
    on_stop_ = std::move(on_stop);
    watchdog_ = std::thread([this] { watch(); });
  }

  // Stops the watchdog and everything else (no more transfers); returns once it has joined.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closing_) return;
      closing_ = true;
    }
    stop(nullptr);
    watch_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

  // Throws a copy of the failure `e`: each thread that learns of it gets its own exception
  // object, to which the executor may add its cell as context without touching the others'.
  [[noreturn]] static void throw_copy(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const c10::Error& x) {
      throw RelayedError(x);
    }
  }

  // An error's text and, for an exception that does not carry it in its text (anything but
  // c10::Error), the pipeline cell it came from (stagewise::error_context).
  static std::string failure_text(const std::exception_ptr& e) {
    std::string what = "unknown error";
    bool has_context = false;
    try {
      if (e) std::rethrow_exception(e);
    } catch (const c10::Error& x) {
      what = detail::what_of(x);
      has_context = true;
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
    }
    if (!has_context) {
      if (auto where = ::stagewise::error_context(e)) what += " (" + where->text() + ")";
    }
    return what;
  }

  // Throws the failure learnt here, unless this rank aborted first (its receivers then return
  // nothing and the executor reports its own error).
  void rethrow_failure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_ && !aborted_here_) throw_copy(failure_);
  }
  // Throws the failure learnt here, even after an abort here.
  void throw_if_failed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) throw_copy(failure_);
  }
  bool aborted_here() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborted_here_;
  }
  // No more transfers: a failure, an abort here, or closing.
  bool stopped() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stopped_;
  }
  // A failure learnt here or an abort here (the rank that serves the store then lingers).
  bool failed_or_aborted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return failure_ || aborted_here_;
  }
  // The failure learnt here (null if none).
  std::exception_ptr failure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return failure_;
  }

  // This rank aborts with `e`: no failure learnt later replaces it, everything stops (the step's
  // mailbox with `e`), and the other ranks learn it through the store (naming this rank).
  void abort_here(const std::exception_ptr& e) {
    {
      // Marked aborted here before the store hears of it: this rank's own store poll must not
      // take its own published failure for another rank's and report that instead of `e`.
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_here_ = true;
    }
    stop(e);
    publish("rank " + link_.name_of(link_.rank()) + " failed: " + failure_text(e));
    acknowledge(link_.rank());
    linger();
  }

  // A connection to `peer` broke while this rank exchanged `k` with it: the peer died or stopped.
  [[noreturn]] void fail_peer(int peer, const MessageKey& k, const std::exception& e) {
    throw_if_failed();
    rethrow_published_soon();
    const std::string what = cause_of_lost_peer(
        peer, "rank " + link_.name_of(peer) + " is gone: its connection closed while rank " +
                  link_.name_of(link_.rank()) + " exchanged " + detail::describe(k) +
                  " with it; it crashed, was killed, or exited early (see its output). " +
                  "Transport error: " + detail::what_of(e));
    acknowledge(peer);  // it will never read the cause
    publish_and_fail(what);
    rethrow_failure();
    TORCH_CHECK(false, "stagewise: ", what);
  }

  // After a connection closed: a rank that failed published why before it exited, and that is
  // the cause to report. The closed connection can be seen here before the store answers with
  // it, so look a few times (at most max(3 polls, 300 ms)); if the cause comes, fail with it and
  // throw it, else return.
  void rethrow_published_soon() {
    const auto until = std::chrono::steady_clock::now() +
                       std::max(3 * options_.poll(), std::chrono::milliseconds(300));
    while (true) {
      if (auto published = read_published()) {
        fail(*published);
        rethrow_failure();
      }
      if (store_lost_ || std::chrono::steady_clock::now() > until) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // Records a failure seen or learnt here and stops everything.
  void fail(const std::string& what) {
    std::exception_ptr failure;
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_here_) return;
      if (!failure_) {
        first = true;
        try {
          TORCH_CHECK(false, "stagewise: ", what, ". Rank ", link_.job_rank(link_.rank()),
                      " stops too.");
        } catch (...) {
          failure_ = std::current_exception();
        }
      }
      failure = failure_;
    }
    stop(failure);
    if (first) acknowledge(link_.rank());
  }

  // Tells the other ranks (first writer wins); the store may be gone already.
  void publish(const std::string& what) {
    if (store_lost_) return;
    try {
      const std::vector<std::uint8_t> value(what.begin(), what.end());
      store_->compareSet(abort_key_, {}, value);
    } catch (...) {
    }
  }

  // Tells the other ranks of `what` and fails this one with what the store then holds: the
  // first failure any rank published, so that every rank reports the same one.
  void publish_and_fail(const std::string& what) {
    publish(what);
    fail(read_published().value_or(what));
  }

  // Tells the rank serving the store that rank `who` (this one, or a peer found dead) knows the
  // job failed, or never will (see linger).
  void acknowledge(int who) { acknowledge_job_rank(link_.job_rank(who)); }
  void acknowledge_job_rank(int who) {
    if (store_lost_) return;
    try {
      store_->set(seen_key_ + "/" + std::to_string(who), std::vector<std::uint8_t>{1});
    } catch (...) {
    }
  }

  // On the rank that serves the store, after a failure (its own, or one it learnt): waits until
  // every rank has acknowledged it (or was found dead by a rank that did), at most max(10 polls,
  // 1 s) and never beyond the timeout, so that no rank is left to report a lost store instead of
  // the cause. Elsewhere, and a second time, it returns at once.
  void linger() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!serves_store_ || lingered_) return;
      lingered_ = true;
    }
    std::vector<std::string> keys;
    // Every rank of the job: a subgroup's failure is the whole job's.
    for (int r = 0; r < job_size_; ++r) keys.push_back(seen_key_ + "/" + std::to_string(r));
    const auto most = std::min<std::chrono::milliseconds>(
        options_.timeout(),
        std::max<std::chrono::milliseconds>(10 * options_.poll(), std::chrono::seconds(1)));
    const auto until = std::chrono::steady_clock::now() + most;
    while (std::chrono::steady_clock::now() < until) {
      try {
        if (store_->check(keys)) return;
      } catch (...) {
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  // What a failed rank wrote to the store, if anything. Once the store has stopped answering
  // (its rank is gone), it is not asked again: LibTorch 2.x logs every failed request.
  std::optional<std::string> read_published() {
    if (store_lost_) return std::nullopt;
    try {
      if (store_->check({abort_key_})) {
        const auto v = store_->get(abort_key_);
        return std::string(v.begin(), v.end());
      }
    } catch (...) {
      store_lost_ = true;
    }
    return std::nullopt;
  }

  // The failure to report when rank `peer`'s connection closed: the one a rank published, or,
  // if the store is gone too, the loss of the rank serving it (it may have died first and taken
  // the others' word with it), else `peer`'s.
  std::string cause_of_lost_peer(int peer, const std::string& peer_gone) {
    if (store_lost_ && link_.job_rank(peer) != 0) {
      return "rank 0, which serves the job's store, is gone: the store stopped answering and "
             "rank " +
             link_.name_of(peer) + "'s connection closed while rank " +
             link_.name_of(link_.rank()) +
             " waited; rank 0 crashed, was killed, or exited early (see its output), and rank " +
             link_.name_of(peer) + " stopped after it";
    }
    return peer_gone;
  }

 private:
  // Stops everything once: the listeners hear `cause` outside this lock.
  void stop(const std::exception_ptr& cause) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
    }
    // Every call reaches the listeners: an abort after a failure still aborts the mailbox with
    // its own error (the mailbox keeps the first), and closing after either changes nothing.
    if (on_stop_) on_stop_(cause);
  }

  // Background: another rank's failure in the store, and receives past their deadline, once per
  // poll. Nothing but closing wakes it in between: a store request per message would cost each
  // message a round trip to the rank serving the store, and wake its threads.
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    auto next = std::chrono::steady_clock::now() + options_.poll();
    while (!closing_) {
      if (watch_.wait_until(lock, next, [&] { return closing_; })) continue;
      next = std::chrono::steady_clock::now() + options_.poll();
      if (stopped_) continue;
      lock.unlock();
      if (auto stuck = overdue_()) {
        publish_and_fail(*stuck);
      } else if (!store_lost_) {
        // Once rank 0, which serves the store, has exited, the store is not asked again; if it
        // died, the Gloo connections to it fail the receives that wait on it, and the deadline
        // bounds the others.
        if (auto published = read_published()) fail(*published);
      }
      lock.lock();
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  C10dOptions options_;
  const Link& link_;
  std::string abort_key_;
  std::string seen_key_;  // <seen_key_>/<rank>: that rank learnt of a failure (acknowledge, linger)
  bool serves_store_ = false;
  int job_size_ = 1;
  std::atomic<bool> store_lost_{false};  // the store stopped answering: not asked again
  Overdue overdue_;
  OnStop on_stop_;
  std::thread watchdog_;

  mutable std::mutex mutex_;       // everything below
  std::condition_variable watch_;  // the watchdog: closing
  bool stopped_ = false;           // no more transfers: failure, abort here, or closing
  bool aborted_here_ = false;      // abort_here() was called
  bool closing_ = false;
  bool lingered_ = false;
  std::exception_ptr failure_;
};

}  // namespace stagewise::runtime::detail
