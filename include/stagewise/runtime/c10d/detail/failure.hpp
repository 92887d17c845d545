#pragma once

#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/keys.hpp"
#include "stagewise/runtime/c10d/options.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"
#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/transport.hpp"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// The state C10dTransport's threads share, under one mutex (its pending transfers, its failure,
// this step's MailboxTransport), and how a failure spreads: to the store for the other ranks, to
// every pending transfer and to the local mailbox. The watchdog (`watch`) and the reaper (`reap`)
// run here; C10dTransport starts and joins their threads.
class C10dFailures {
 protected:
  C10dFailures(const Connection& c, C10dOptions options)
      : group_(c.group),
        store_(c.store),
        options_(std::move(options)),
        abort_key_(options_.prefix() + "/abort"),
        seen_key_(options_.prefix() + "/abort_seen"),
        serves_store_(c.serves_store),
        job_ranks_(c.job_ranks),
        job_size_(c.job_world()) {
    ignore_sigpipe();  // also for a connection the caller built (group.hpp)
  }
  ~C10dFailures() = default;

  C10dFailures(const C10dFailures&) = delete;
  C10dFailures& operator=(const C10dFailures&) = delete;

  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    int peer = 0;
    MessageKey key;
  };
  struct Waiting {
    c10::intrusive_ptr<c10d::Work> work;
    int peer = 0;
    MessageKey key;
    std::chrono::steady_clock::time_point deadline;
  };

  int rank() const { return group_.rank(); }
  // The job rank of this group's rank `r` (they differ in a subgroup of a larger job), as errors
  // name it.
  int job_rank(int r) const {
    return job_ranks_.empty() ? r : job_ranks_.at(static_cast<std::size_t>(r));
  }
  std::string name_of(int r) const { return std::to_string(job_rank(r)); }

  // Throws a copy of the failure `e`: each thread that learns of it gets its own exception
  // object, to which the executor may add its cell as context without touching the others'.
  [[noreturn]] static void throw_copy(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const c10::Error& x) {
      throw RelayedError(x);
    }
  }

  void abort_local(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (local_) local_->abort(e);
  }

  // Throws the failure learnt here, unless this rank aborted first (its receivers then return
  // nothing and the executor reports its own error).
  void rethrow_failure() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_ && !aborted_here_) throw_copy(failure_);
  }

  bool aborted_here() {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborted_here_;
  }

  // A connection to `peer` broke while this rank waited on it: the peer died or stopped.
  [[noreturn]] void fail_peer(int peer, const MessageKey& k, const std::exception& e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_) throw_copy(failure_);
    }
    rethrow_published_soon();
    const std::string what = cause_of_lost_peer(
        peer, "rank " + name_of(peer) + " is gone: its connection closed while rank " +
                  name_of(rank()) + " exchanged " + detail::describe(k) +
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

  // Records a failure seen or learnt here and cancels every pending transfer.
  void fail(const std::string& what) {
    std::exception_ptr failure;
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_here_) return;
      if (!failure_) {
        first = true;
        try {
          TORCH_CHECK(false, "stagewise: ", what, ". Rank ", job_rank(rank()), " stops too.");
        } catch (...) {
          failure_ = std::current_exception();
        }
      }
      failure = failure_;
      stopped_ = true;
      abort_works_locked();
    }
    wake_all();
    abort_local(failure);
    if (first) acknowledge(rank());
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

  // Tells the rank serving the store that rank `who` (this one, or a peer found dead) knows the
  // job failed, or never will (see linger).
  void acknowledge(int who) { acknowledge_job_rank(job_rank(who)); }
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

  // Tells the other ranks of `what` and fails this one with what the store then holds: the
  // first failure any rank published, so that every rank reports the same one.
  void publish_and_fail(const std::string& what) {
    publish(what);
    fail(read_published().value_or(what));
  }

  // The failure to report when rank `peer`'s connection closed: the one a rank published, or,
  // if the store is gone too, the loss of the rank serving it (it may have died first and taken
  // the others' word with it), else `peer`'s.
  std::string cause_of_lost_peer(int peer, const std::string& peer_gone) {
    if (store_lost_ && job_rank(peer) != 0) {
      return "rank 0, which serves the job's store, is gone: the store stopped answering and "
             "rank " +
             name_of(peer) + "'s connection closed while rank " + name_of(rank()) +
             " waited; rank 0 crashed, was killed, or exited early (see its output), and rank " +
             name_of(peer) + " stopped after it";
    }
    return peer_gone;
  }

  // Wakes every thread that waits on this transport's state: after a failure, an abort, or at
  // closing. Otherwise each condition below is notified only by what its waiter waits for.
  void wake_all() {
    watch_.notify_all();
    sent_.notify_all();
    expected_.notify_all();
    arrived_.notify_all();
  }

  void abort_works_locked() {
    for (auto& [id, w] : waiting_) w.work->abort();
    for (auto& s : sends_) s.work->abort();
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
      std::string stuck;
      const auto now = std::chrono::steady_clock::now();
      for (const auto& [id, w] : waiting_) {
        if (now > w.deadline) {
          stuck = "rank " + name_of(rank()) + " waited more than " +
                  std::to_string(options_.timeout().count()) + " ms for " +
                  detail::describe(w.key) + " from rank " + name_of(w.peer) +
                  "; that rank is stuck or slower than " +
                  "the timeout (raise C10dOptions::timeout if its stage is just slow)";
          break;
        }
      }
      if (!stuck.empty()) {
        lock.unlock();
        publish_and_fail(stuck);
        lock.lock();
        continue;
      }
      // Once rank 0, which serves the store, has exited, the store is not asked again; if it
      // died, the Gloo connections to it fail the receives that wait on it, and the deadline
      // bounds the others.
      if (store_lost_) continue;
      lock.unlock();
      if (auto published = read_published()) fail(*published);
      lock.lock();
    }
  }

  // Background: completes this rank's sends in order, so their tensors are freed early.
  void reap() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      sent_.wait(lock, [&] { return closing_ || !sends_.empty(); });
      if (sends_.empty()) return;
      Pending p = sends_.front();
      sending_ = true;
      lock.unlock();
      std::optional<std::string> broken;
      try {
        p.work->wait();
      } catch (const std::exception& e) {
        broken = detail::what_of(e);
      }
      lock.lock();
      sends_.pop_front();
      sending_ = false;
      if (broken && !stopped_) {
        const std::string what = "rank " + name_of(p.peer) +
                                 " is gone: its connection closed while rank " + name_of(rank()) +
                                 " sent it " + detail::describe(p.key) +
                                 "; it crashed, was killed, or exited early (see its output). "
                                 "Transport error: " +
                                 *broken;
        lock.unlock();
        if (auto published = read_published()) {
          fail(*published);
        } else {
          acknowledge(p.peer);  // it will never read the cause
          publish_and_fail(cause_of_lost_peer(p.peer, what));
        }
        lock.lock();
      }
      idle_.notify_all();
    }
  }

  PointToPoint group_;
  c10::intrusive_ptr<c10d::Store> store_;
  C10dOptions options_;
  std::string abort_key_;
  std::string seen_key_;  // <seen_key_>/<rank>: that rank learnt of a failure (acknowledge, linger)
  bool serves_store_ = false;
  std::vector<int> job_ranks_;  // of each group rank; empty: the group is the job
  int job_size_ = 1;
  bool lingered_ = false;
  std::atomic<bool> store_lost_{false};      // the store stopped answering: not asked again
  std::unique_ptr<MailboxTransport> local_;  // this step's, between stages of this process

  mutable std::mutex mutex_;  // everything below, and C10dReceiver's next_id_, ahead_ and arrivals_
  std::condition_variable watch_;     // the watchdog: closing
  std::condition_variable sent_;      // the reaper: a send posted, or closing
  std::condition_variable expected_;  // the receiver thread: a receive posted ahead, or closing
  std::condition_variable arrived_;   // take_ahead: an expected message arrived, or a failure
  std::condition_variable idle_;      // the destructor: every send completed
  std::deque<Pending> sends_;
  bool sending_ = false;
  std::map<std::uint64_t, Waiting> waiting_;
  bool stopped_ = false;       // no more transfers: failure, abort here, or closing
  bool aborted_here_ = false;  // abort() was called on this rank
  bool closing_ = false;
  std::exception_ptr failure_;
};

}  // namespace stagewise::runtime::detail
