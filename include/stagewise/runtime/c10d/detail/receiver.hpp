#pragma once

#include "stagewise/runtime/c10d/detail/arrival.hpp"
#include "stagewise/runtime/c10d/detail/failure_watch.hpp"
#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/detail/link.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/options.hpp"
#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/stream.hpp"

#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// How C10dTransport receives from another rank: receives posted (and watched for their deadline)
// one transfer at a time, or ahead of time (`expect`) and completed in order by the receiver
// thread (`receive_ahead`), which `take_ahead` waits for. Every message is checked against its
// header and every reply against what this rank sent for it (`replies`). Its own lock guards its
// posted receives and arrivals; the failure watch stops it (`stop`: every posted receive
// aborted, its waiters woken).
class Receiver {
 public:
  Receiver(Link& link, FailureWatch& watch, const C10dOptions& options)
      : link_(link), watch_(watch), options_(options) {}
  ~Receiver() { close(); }

  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  void start() {
    thread_ = std::thread([this] { receive_ahead(); });
  }

  // The form of the gradients due for what this rank sent (checked on their arrival).
  Replies& replies() { return replies_; }

  // The bytes a message's first transfer carries after its header (detail/header.hpp): room for
  // small tensors over Gloo, none over NCCL.
  std::int64_t inline_room() const { return options_.device().is_cpu() ? kInlineBytes : 0; }

  // The receive a message's first transfer arrives in: its header and the inline room.
  torch::Tensor first_part() const { return first_receive(options_.device(), inline_room()); }

  // Receives the message `k` from rank `src` under `tag`: its first part, then the rest.
  std::optional<Message> receive_message(int src, int tag, const MessageKey& k,
                                         bool counted = true) {
    auto first = first_part();
    if (!receive(first, src, tag, k)) return std::nullopt;
    return receive_rest(first, src, tag, k, counted);
  }

  // Posts the receive of message `k`'s first part from rank `src` now; the receiver thread
  // completes it in posting order, and `take_ahead(k)` takes it. False once aborted here.
  bool expect(const MessageKey& k, int src, int tag) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(arrivals_.find(k) == arrivals_.end(),
                  "stagewise::C10dTransport::expect: ", detail::describe(k),
                  " is expected twice in one step");
    }
    Ahead a{k, src, tag, first_part(), 0};
    auto id = post(a.header, src, a.tag, k, std::chrono::steady_clock::time_point::max());
    if (!id) return false;  // aborted here
    a.id = *id;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      arrivals_.emplace(k, Arrival{});
      ahead_.push_back(std::move(a));
    }
    expected_.notify_one();
    return true;
  }

  // The rest of a message whose first part `first` (first_part()) has arrived: the header's
  // tail, then the tensors, which are in `first` already when they travelled inline; counted in
  // the traffic unless `counted` is false. Every transfer is checked against the header (its
  // version, length and end mark; a separate tensor's announced size before its receive is
  // posted, and its last bytes after), and a reply against what this rank sent for it, before
  // anything is allocated for it. Nothing once this process aborted.
  std::optional<Message> receive_rest(const torch::Tensor& first, int src, int tag,
                                      const MessageKey& k, bool counted = true) {
    const auto from = [&] {
      return "rank " + link_.name_of(src) + " (for " + detail::describe(k) + ")";
    };
    const auto cpu = copy_to(first, torch::kCPU);
    const std::int64_t n = detail::check_first(cpu, from);
    const auto* w = cpu.data_ptr<std::int64_t>();
    std::vector<std::int64_t> words(w, w + std::min(n, kFirstWords));
    if (n > kFirstWords) {
      auto more = detail::rest_receive(n, options_.device());
      if (!receive(more, src, tag, k)) return std::nullopt;
      const auto rest = copy_to(more, torch::kCPU);
      detail::check_rest(rest, from);
      const auto* r = rest.data_ptr<std::int64_t>();
      words.insert(words.end(), r, r + (n - kFirstWords));
    }
    const auto layout =
        detail::parse_header(words, options_.max_message_bytes(), inline_room(), from);
    detail::check_form(k, layout, link_.name_of(src));
    replies_.check(k, layout, link_.name_of(src));
    Message m = detail::allocate(layout, options_.device());
    std::int64_t bytes = 0;
    if (layout.inlined) {  // parse_header checked that they fit the room
      const auto* payload = reinterpret_cast<const char*>(w + kFirstWords);
      for (auto& t : m.tensors) {
        if (!t.defined() || t.numel() == 0) continue;
        std::memcpy(t.data_ptr(), payload + bytes, t.nbytes());
        bytes += static_cast<std::int64_t>(t.nbytes());
      }
    } else {
      detail::clear_tails(m, layout);
      for (auto& t : m.tensors) {
        if (!t.defined() || t.numel() == 0) continue;
        if (!receive(t, src, tag, k)) return std::nullopt;
        bytes += static_cast<std::int64_t>(t.nbytes());
      }
      detail::check_tails(m, layout, from);
    }
    if (counted) {
      ++messages_received_;
      bytes_received_ += bytes;
    }
    return m;
  }

  // Waits for expected message `k` (from rank `src`), completed by the receiver thread;
  // `expected` false when `k` was not expected this step (then nothing was waited for). The
  // wait is bounded by the timeout from the moment this rank needs the message.
  std::optional<Message> take_ahead(const MessageKey& k, int src, bool& expected) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = arrivals_.find(k);
    expected = it != arrivals_.end();
    if (!expected) return std::nullopt;
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout();
    while (true) {
      it = arrivals_.find(k);
      if (it->second.done) {
        Arrival a = std::move(it->second);
        arrivals_.erase(it);
        lock.unlock();
        if (a.error) std::rethrow_exception(a.error);
        return std::move(a.message);
      }
      if (stopped_) {
        // Stopped by a failure (thrown here) or an abort here (nothing to return).
        lock.unlock();
        watch_.rethrow_failure();
        return std::nullopt;
      }
      if (arrived_.wait_until(lock, deadline) == std::cv_status::timeout &&
          !arrivals_.find(k)->second.done && !stopped_) {
        const std::string stuck =
            "rank " + link_.name_of(link_.rank()) + " waited more than " +
            std::to_string(options_.timeout().count()) + " ms for " + detail::describe(k) +
            " from rank " + link_.name_of(src) + "; that rank is stuck or slower than " +
            "the timeout (raise C10dOptions::timeout if its stage is just slow)";
        lock.unlock();
        watch_.publish(stuck);
        watch_.fail(stuck);
        lock.lock();
      }
    }
  }

  // For the failure watch: what the first receive waiting past its deadline waits for.
  std::optional<std::string> overdue() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return std::nullopt;
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [id, w] : waiting_) {
      if (now > w.deadline) {
        return "rank " + link_.name_of(link_.rank()) + " waited more than " +
               std::to_string(options_.timeout().count()) + " ms for " + detail::describe(w.key) +
               " from rank " + link_.name_of(w.peer) + "; that rank is stuck or slower than " +
               "the timeout (raise C10dOptions::timeout if its stage is just slow)";
      }
    }
    return std::nullopt;
  }

  // Aborts every posted receive and wakes every waiter; receives posted after are aborted too.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
      for (auto& [id, w] : waiting_) w.work->abort();
    }
    expected_.notify_all();
    arrived_.notify_all();
  }

  // Stops and joins the receiver thread.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
    }
    stop();
    if (thread_.joinable()) thread_.join();
  }

  // Forgets the expected replies (a new step).
  void begin_step() { replies_.clear(); }

  std::int64_t messages_received() const { return messages_received_.load(); }
  std::int64_t bytes_received() const { return bytes_received_.load(); }

 private:
  // A message whose first part's receive was posted ahead (by `expect`).
  struct Ahead {
    MessageKey key;
    int src = 0;
    int tag = 0;
    torch::Tensor header;
    std::uint64_t id = 0;  // the first part's receive, in waiting_
  };
  // What the receiver thread got for an expected message.
  struct Arrival {
    bool done = false;
    std::optional<Message> message;  // nothing: this rank aborted
    std::exception_ptr error;
  };
  // A posted receive, which the failure watch fails after its deadline.
  struct Waiting {
    c10::intrusive_ptr<c10d::Work> work;
    int peer = 0;
    MessageKey key;
    std::chrono::steady_clock::time_point deadline;
  };

  // Background: completes the messages posted ahead, in order, and hands them to take_ahead.
  void receive_ahead() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      expected_.wait(lock, [&] { return closing_ || !ahead_.empty(); });
      if (ahead_.empty()) return;
      Ahead a = std::move(ahead_.front());
      ahead_.pop_front();
      lock.unlock();
      Arrival got;
      got.done = true;
      try {
        if (await(a.id, a.src, a.key)) got.message = receive_rest(a.header, a.src, a.tag, a.key);
      } catch (...) {
        got.error = std::current_exception();
      }
      lock.lock();
      arrivals_[a.key] = std::move(got);
      arrived_.notify_all();
    }
  }

  // Receives into `t`; false once aborted here; throws the failure otherwise.
  bool receive(torch::Tensor& t, int src, int tag, const MessageKey& k) {
    auto id = post(t, src, tag, k, std::chrono::steady_clock::now() + options_.timeout());
    return id && await(*id, src, k);
  }

  // Posts a receive into `t`, which the failure watch fails after `deadline`; its id in
  // waiting_, or nothing once aborted here; throws the failure otherwise.
  std::optional<std::uint64_t> post(const torch::Tensor& t, int src, int tag, const MessageKey& k,
                                    std::chrono::steady_clock::time_point deadline) {
    std::vector<at::Tensor> in{t};
    watch_.rethrow_failure();
    c10::intrusive_ptr<c10d::Work> work;
    try {
      // Posts are serialised with the sends: a process group's calls may share state.
      std::lock_guard<std::mutex> posting(link_.post);
      work = link_.group.recv(in, src, tag);
    } catch (const std::exception& e) {
      if (watch_.aborted_here()) return std::nullopt;
      watch_.fail_peer(src, k, e);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const std::uint64_t id = next_id_++;
    waiting_.emplace(id, Waiting{work, src, k, deadline});
    if (stopped_) work->abort();
    return id;
  }

  // Waits for the receive `id` posted from rank `src`; false once aborted here.
  bool await(std::uint64_t id, int src, const MessageKey& k) {
    c10::intrusive_ptr<c10d::Work> work;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      work = waiting_.at(id).work;
    }
    bool done = false;
    try {
      done = work->wait();
    } catch (const std::exception& e) {
      forget(id);
      if (watch_.aborted_here()) return false;
      watch_.fail_peer(src, k, e);
    }
    forget(id);
    if (!done) watch_.rethrow_failure();
    return done;
  }

  void forget(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_.erase(id);
  }

  Link& link_;
  FailureWatch& watch_;
  const C10dOptions& options_;
  Replies replies_;  // has a lock of its own
  std::atomic<std::int64_t> messages_received_{0}, bytes_received_{0};
  std::thread thread_;

  std::mutex mutex_;                  // everything below
  std::condition_variable expected_;  // the receiver thread: a receive posted ahead, or closing
  std::condition_variable arrived_;   // take_ahead: an expected message arrived, or a stop
  std::map<std::uint64_t, Waiting> waiting_;
  std::uint64_t next_id_ = 0;
  std::deque<Ahead> ahead_;                           // posted ahead, not yet received
  std::unordered_map<MessageKey, Arrival> arrivals_;  // expected this step, by key
  bool stopped_ = false;
  bool closing_ = false;
};

}  // namespace stagewise::runtime::detail
