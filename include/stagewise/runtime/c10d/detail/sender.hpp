#pragma once

#include "stagewise/runtime/c10d/detail/failure_watch.hpp"
#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/detail/link.hpp"
#include "stagewise/runtime/message.hpp"

#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// How C10dTransport sends to another rank: a message's transfers posted together on the group
// (under the link's post lock), then completed in order by the reaper thread, which frees their
// tensors early and reports a peer whose connection closed. Its own lock guards its pending
// sends; the failure watch stops it (`stop`: every pending send aborted, no more posted).
class Sender {
 public:
  Sender(Link& link, FailureWatch& watch) : link_(link), watch_(watch) {}
  ~Sender() { close(); }

  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  void start() {
    reaper_ = std::thread([this] { reap(); });
  }

  // Posts `transfers` (one message, `k`, to rank `dst` under `tag`) in order; returns once they
  // are started (true), or false once this rank aborted; throws the failure watch's error if the
  // connection closed.
  bool send(int dst, int tag, const MessageKey& k, const std::vector<torch::Tensor>& transfers) {
    // One thread posts a message's sends in order: Gloo matches one tag's messages in order.
    std::lock_guard<std::mutex> post(link_.post);
    for (const auto& t : transfers) {
      std::vector<at::Tensor> one{t};
      c10::intrusive_ptr<c10d::Work> work;
      try {
        work = link_.group.send(one, dst, tag);
      } catch (const std::exception& e) {
        // The connection to `dst` closed: say why (a failure it published, else that it is gone).
        if (watch_.aborted_here()) return false;
        watch_.fail_peer(dst, k, e);
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) work->abort();
      sends_.push_back({std::move(work), dst, k});
    }
    sent_.notify_one();
    return true;
  }

  // Aborts every pending send; none is posted after (a failure, an abort here, or closing).
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
      for (auto& s : sends_) s.work->abort();
    }
    sent_.notify_all();
  }

  // Waits, at most `timeout`, until every send posted has completed.
  void drain(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait_for(lock, timeout, [&] { return sends_.empty() && !sending_; });
  }

  // Stops and joins the reaper.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
    }
    stop();
    if (reaper_.joinable()) reaper_.join();
  }

 private:
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    int peer = 0;
    MessageKey key;
  };

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
        const std::string what =
            "rank " + link_.name_of(p.peer) + " is gone: its connection closed while rank " +
            link_.name_of(link_.rank()) + " sent it " + detail::describe(p.key) +
            "; it crashed, was killed, or exited early (see its output). "
            "Transport error: " +
            *broken;
        lock.unlock();
        if (auto published = watch_.read_published()) {
          watch_.fail(*published);
        } else {
          watch_.acknowledge(p.peer);  // it will never read the cause
          watch_.publish_and_fail(watch_.cause_of_lost_peer(p.peer, what));
        }
        lock.lock();
      }
      idle_.notify_all();
    }
  }

  Link& link_;
  FailureWatch& watch_;
  std::thread reaper_;

  std::mutex mutex_;              // everything below
  std::condition_variable sent_;  // the reaper: a send posted, or closing
  std::condition_variable idle_;  // drain: every send completed
  std::deque<Pending> sends_;
  bool sending_ = false;
  bool stopped_ = false;
  bool closing_ = false;
};

}  // namespace stagewise::runtime::detail
