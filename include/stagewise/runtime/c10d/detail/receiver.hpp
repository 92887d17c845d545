#pragma once

#include "stagewise/runtime/c10d/detail/arrival.hpp"
#include "stagewise/runtime/c10d/detail/failure.hpp"
#include "stagewise/runtime/c10d/detail/header.hpp"
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
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// How C10dTransport receives from another rank: receives posted (and watched for their deadline)
// one tensor at a time, or ahead of time by `expect` and completed in order by the receiver
// thread (`receive_ahead`, started and joined by C10dTransport), which `take_ahead` waits for.
// Also holds what C10dTransport's sends share with the receives: the mutex that serialises their
// posts, the counters of the traffic with other ranks, and the form of the replies due for what
// it sent (Replies).
class C10dReceiver : protected C10dFailures {
 protected:
  C10dReceiver(const Connection& c, C10dOptions options) : C10dFailures(c, std::move(options)) {}
  ~C10dReceiver() = default;

  // A message whose header receive was posted ahead (by `expect`).
  struct Ahead {
    MessageKey key;
    int src = 0;
    int tag = 0;
    torch::Tensor header;
    std::uint64_t id = 0;  // the header's receive, in waiting_
  };
  // What the receiver thread got for an expected message.
  struct Arrival {
    bool done = false;
    std::optional<Message> message;  // nothing: this rank aborted
    std::exception_ptr error;
  };

  // The bytes a message's first transfer carries after its header (detail/header.hpp): room for
  // small tensors over Gloo, none over NCCL.
  std::int64_t inline_room() const { return options_.device().is_cpu() ? kInlineBytes : 0; }

  // The receive a message's first transfer arrives in: its header and the inline room.
  torch::Tensor first_part() const { return first_receive(options_.device(), inline_room()); }

  // The rest of a message whose first part `first` (first_part()) has arrived: the header's
  // tail, then the tensors, which are in `first` already when they travelled inline; counted in
  // the traffic unless `counted` is false. Every transfer is checked against the header (its
  // version, length and end mark; a separate tensor's announced size before its receive is
  // posted, and its last bytes after), and a reply against what this rank sent for it, before
  // anything is allocated for it. Nothing once this process aborted.
  std::optional<Message> receive_rest(const torch::Tensor& first, int src, int tag,
                                      const MessageKey& k, bool counted = true) {
    const auto from = [&] { return "rank " + name_of(src) + " (for " + detail::describe(k) + ")"; };
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
    detail::check_form(k, layout, name_of(src));
    replies_.check(k, layout, name_of(src));
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
      if (failure_ && !aborted_here_) throw_copy(failure_);
      if (aborted_here_) return std::nullopt;
      if (arrived_.wait_until(lock, deadline) == std::cv_status::timeout &&
          !arrivals_.find(k)->second.done) {
        const std::string stuck =
            "rank " + name_of(rank()) + " waited more than " +
            std::to_string(options_.timeout().count()) + " ms for " + detail::describe(k) +
            " from rank " + name_of(src) + "; that rank is stuck or slower than " +
            "the timeout (raise C10dOptions::timeout if its stage is just slow)";
        lock.unlock();
        publish(stuck);
        fail(stuck);
        lock.lock();
      }
    }
  }

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

  // Posts a receive into `t`, which the watchdog fails after `deadline`; its id in waiting_, or
  // nothing once aborted here; throws the failure otherwise.
  std::optional<std::uint64_t> post(const torch::Tensor& t, int src, int tag, const MessageKey& k,
                                    std::chrono::steady_clock::time_point deadline) {
    std::vector<at::Tensor> in{t};
    rethrow_failure();
    c10::intrusive_ptr<c10d::Work> work;
    try {
      // Posts are serialised with the sends: a process group's calls may share state.
      std::lock_guard<std::mutex> posting(post_);
      work = group_.recv(in, src, tag);
    } catch (const std::exception& e) {
      if (aborted_here()) return std::nullopt;
      fail_peer(src, k, e);
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
      if (aborted_here()) return false;
      fail_peer(src, k, e);
    }
    forget(id);
    if (!done) rethrow_failure();
    return done;
  }

  void forget(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_.erase(id);
  }

  Replies replies_;  // the form of the gradients due for what this rank sent
  std::atomic<std::int64_t> messages_sent_{0}, bytes_sent_{0};  // to other ranks
  std::atomic<std::int64_t> messages_received_{0}, bytes_received_{0};

  std::mutex post_;  // one message's sends go out together
  // Under C10dFailures::mutex_:
  std::uint64_t next_id_ = 0;
  std::deque<Ahead> ahead_;                           // posted ahead, not yet received
  std::unordered_map<MessageKey, Arrival> arrivals_;  // expected this step, by key
};

}  // namespace stagewise::runtime::detail
