#pragma once

#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/header.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"
#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/transport.hpp"
#include "stagewise/schedule/comms.hpp"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// Options of the c10d transport.
///   stagewise::runtime::C10dOptions().timeout(std::chrono::seconds(5))
struct C10dOptions {
  /// The longest a receive waits before the job is declared stuck (every rank then fails); also
  /// how long a finished rank waits for its last sends to be received. Default 30 s.
  C10dOptions& timeout(std::chrono::milliseconds t) {
    timeout_ = t;
    return *this;
  }
  /// How often each rank looks for another rank's failure in the store. Default 100 ms.
  C10dOptions& poll(std::chrono::milliseconds p) {
    poll_ = p;
    return *this;
  }
  /// Where received tensors are allocated: CPU for Gloo, this rank's GPU for NCCL.
  C10dOptions& device(torch::Device d) {
    device_ = d;
    return *this;
  }
  /// Store keys of this transport start with it; two pipes sharing a store need different ones.
  C10dOptions& prefix(std::string p) {
    prefix_ = std::move(p);
    return *this;
  }

  std::chrono::milliseconds timeout_{30000};
  std::chrono::milliseconds poll_{100};
  torch::Device device_{torch::kCPU};
  std::string prefix_{"stagewise"};
};

/// What one rank exchanged with the other ranks: messages and the bytes of their tensors' data.
/// Message headers (a few dozen bytes each) are not counted, nor are messages between stages
/// of the same rank, which move no bytes.
///   auto t = pipe.traffic();  // distributed::Pipe, cumulative since it was built
///   std::printf("%lld bytes sent in %lld messages\n", (long long)t.bytes_sent,
///               (long long)t.messages_sent);
struct C10dTraffic {
  std::int64_t messages_sent = 0;
  std::int64_t bytes_sent = 0;
  std::int64_t messages_received = 0;
  std::int64_t bytes_received = 0;
};

namespace detail {

inline std::string describe(const MessageKey& k) {
  const char* what = k.kind == MessageKind::activation ? "the activation"
                     : k.kind == MessageKind::gradient ? "the gradient"
                     : k.kind == MessageKind::skip     ? "skip"
                                                       : "the gradient of skip";
  const bool skip = k.kind == MessageKind::skip || k.kind == MessageKind::skip_grad;
  return std::string(what) + (skip ? " " + std::to_string(k.skip) : "") + " of micro-batch " +
         std::to_string(k.micro) + " for stage " + std::to_string(k.stage);
}

}  // namespace detail

/// The messages worker `w` receives from other workers in a step, in the order it receives
/// them: what `C10dTransport::expect` posts ahead.
///   t.expect(receives_of(schedule::comms(plan, routes), t.rank()));
inline std::vector<MessageKey> receives_of(const schedule::CommPlan& c, int w) {
  std::vector<MessageKey> keys;
  for (const auto& step : c.programs.at(static_cast<std::size_t>(w))) {
    const auto& t = step.transfer;
    if (step.send || c.worker_of(t.from) == w) continue;
    MessageKind kind = MessageKind::activation;
    switch (t.kind) {
      case schedule::TransferKind::activation:
        kind = MessageKind::activation;
        break;
      case schedule::TransferKind::gradient:
        kind = MessageKind::gradient;
        break;
      case schedule::TransferKind::skip:
        kind = MessageKind::skip;
        break;
      case schedule::TransferKind::skip_grad:
        kind = MessageKind::skip_grad;
        break;
    }
    keys.push_back(MessageKey{kind, t.to, t.micro, t.skip});
  }
  return keys;
}

/// Moves messages between the stages of a pipeline whose stages live in several processes:
/// to a stage of this process through the step's MailboxTransport, to another rank over c10d
/// point-to-point. A message to another rank is a header (number of tensors, atomic flag, and
/// per tensor: defined?, dtype, shape) followed by one send per non-empty tensor, all under one
/// tag derived from the key and the step, so receivers need no shapes in advance and keys
/// cannot mix across steps.
///
/// Failures end the whole job, boundedly: a rank that calls `abort(e)` writes its error to the
/// store, where every other rank looks every `poll`; a rank whose connection closes (killed,
/// crashed) is named by the ranks that talk to it, which write that to the store too; a
/// receive that waits longer than `timeout` fails on its rank and then on all. `recv` then
/// throws c10::Error naming the failed rank; after this process's own `abort` it returns
/// nothing.
///   auto c = stagewise::runtime::connect(stagewise::runtime::rendezvous_env());
///   stagewise::runtime::C10dTransport t(c, [](int stage) { return stage % 2; }, {});
///   t.begin_step(2, 8, 0);
///   t.send({MessageKind::activation, 1, 0}, {{x}});  // to stage 1, on rank 1
class C10dTransport {
 public:
  /// `rank_of(stage)` places stages on ranks (the plan's `worker_of`); `routes[i]` is skip i's
  /// stash and pop stage, so that a skip's receiver knows where it comes from.
  C10dTransport(const Connection& c, std::function<int(int)> rank_of,
                std::vector<schedule::SkipRoute> routes = {}, C10dOptions options = {})
      : group_(c.group),
        store_(c.store),
        rank_of_(std::move(rank_of)),
        routes_(std::move(routes)),
        options_(std::move(options)),
        abort_key_(options_.prefix_ + "/abort") {
    watchdog_ = std::thread([this] { watch(); });
    reaper_ = std::thread([this] { reap(); });
    receiver_ = std::thread([this] { receive_ahead(); });
  }

  C10dTransport(const C10dTransport&) = delete;
  C10dTransport& operator=(const C10dTransport&) = delete;

  /// Waits (at most `timeout`) for this rank's sends to be received, then stops.
  ~C10dTransport() {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      idle_.wait_for(lock, options_.timeout_, [&] { return sends_.empty() && !sending_; });
      closing_ = true;
      stopped_ = true;
      abort_works_locked();
    }
    wake_.notify_all();
    reaper_.join();
    watchdog_.join();
    receiver_.join();
  }

  /// This process's rank.
  int rank() const { return group_.rank(); }

  /// The messages and tensor bytes this rank sent to and received from other ranks since the
  /// transport was built (each message counted once it is sent, or once it has fully arrived).
  C10dTraffic traffic() const {
    return {messages_sent_.load(), bytes_sent_.load(), messages_received_.load(),
            bytes_received_.load()};
  }

  /// Starts a training step of `stages` stages, `micro_batches` micro-batches and `skips` skip
  /// routes: messages of different steps never match, and messages between stages of this
  /// process go through a MailboxTransport made for the step. Call it on every rank, before
  /// each step.
  void begin_step(int stages, int micro_batches, int skips) {
    if (begun_) ++step_;
    begun_ = true;
    auto local = std::make_unique<MailboxTransport>(stages, micro_batches, skips);
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) local->abort(failure_);
    local_ = std::move(local);
  }

  /// Posts the receives of this step's messages from other ranks now, in the order this rank
  /// will ask for them (`keys`, as `schedule::comms` derives them from the verified plan; keys
  /// from this rank's own stages are left to the local mailbox). A background thread completes
  /// each as its sender sends it, so a message travels while this rank computes, and `recv(k)`
  /// takes it from there. The order must be the plan's: it is the order proved deadlock-free.
  /// On a CPU transport only (Gloo); elsewhere receives are posted when `recv` is called.
  ///   t.begin_step(2, 8, 0);
  ///   t.expect({{MessageKind::activation, 1, 0}, {MessageKind::gradient, 0, 0}});
  void expect(const std::vector<MessageKey>& keys) {
    if (!options_.device_.is_cpu()) return;
    rethrow_failure();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;  // aborted here: nothing more is received
    }
    for (const auto& k : keys) {
      const int from = source_stage(k);
      TORCH_CHECK(from >= 0, "stagewise::C10dTransport::expect: ", detail::describe(k),
                  " has no sending stage (stage 0 receives no activation)");
      const int src = rank_of_(from);
      if (src == rank()) continue;
      Ahead a{k, src, tag_of(k), torch::empty({detail::kHeaderWords}, torch::kInt64), 0};
      {
        std::lock_guard<std::mutex> lock(mutex_);
        TORCH_CHECK(arrivals_.find(k) == arrivals_.end(), "stagewise::C10dTransport::expect: ",
                    detail::describe(k), " is expected twice in one step");
      }
      auto id = post(a.header, src, a.tag, k, std::chrono::steady_clock::time_point::max());
      if (!id) return;  // aborted here
      a.id = *id;
      std::lock_guard<std::mutex> lock(mutex_);
      arrivals_.emplace(k, Arrival{});
      ahead_.push_back(std::move(a));
    }
    wake_.notify_all();
  }

  /// Sends `m` to stage `k.stage`; returns once the sends are started (never waits for the
  /// receiver). After a failure elsewhere it throws that failure.
  void send(const MessageKey& k, Message m) {
    const int dst = rank_of_(k.stage);
    if (dst == rank()) {
      local().send(k, std::move(m));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_) throw_copy(failure_);
      if (stopped_) return;  // this rank aborted: nobody waits for it any more
    }
    const int tag = tag_of(k);
    std::vector<at::Tensor> out;
    const auto words = detail::encode_header(m);
    auto header = torch::zeros(
        {std::max<std::int64_t>(detail::kHeaderWords, static_cast<std::int64_t>(words.size()))},
        torch::kInt64);
    std::copy(words.begin(), words.end(), header.data_ptr<std::int64_t>());
    out.push_back(header.narrow(0, 0, detail::kHeaderWords).to(options_.device_));
    if (header.numel() > detail::kHeaderWords) {
      out.push_back(header.narrow(0, detail::kHeaderWords, header.numel() - detail::kHeaderWords)
                        .contiguous()
                        .to(options_.device_));
    }
    std::int64_t bytes = 0;
    for (const auto& t : m.tensors) {
      if (t.defined() && t.numel() > 0) {
        out.push_back(t.detach().to(options_.device_).contiguous());
        bytes += static_cast<std::int64_t>(out.back().nbytes());
      }
    }
    // One thread posts a message's sends in order: Gloo matches one tag's messages in order.
    std::lock_guard<std::mutex> post(post_);
    for (auto& t : out) {
      std::vector<at::Tensor> one{t};
      c10::intrusive_ptr<c10d::Work> work;
      try {
        work = group_.send(one, dst, tag);
      } catch (const std::exception& e) {
        // The connection to `dst` closed: say why (a failure it published, else that it is gone).
        if (aborted_here()) return;
        fail_peer(dst, k, e);
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) work->abort();
      sends_.push_back({std::move(work), dst, k});
    }
    ++messages_sent_;
    bytes_sent_ += bytes;
    wake_.notify_all();
  }

  /// Waits for the message `k`; nothing once this process aborted; throws c10::Error naming the
  /// failed rank when another rank failed, died or stalled past the timeout.
  std::optional<Message> recv(const MessageKey& k) {
    const int src = rank_of_(source_stage(k));
    if (src == rank()) return local().recv(k);
    bool expected = false;
    auto ahead = take_ahead(k, src, expected);
    if (expected) return ahead;
    const int tag = tag_of(k);
    auto fixed = torch::empty({detail::kHeaderWords},
                              torch::TensorOptions().dtype(torch::kInt64).device(options_.device_));
    if (!receive(fixed, src, tag, k)) return std::nullopt;
    return receive_rest(fixed, src, tag, k);
  }

  /// Stops this rank's communication after a failure here: tells every other rank through the
  /// store (they fail with `e`'s message, naming this rank), wakes this process's receivers
  /// (they return nothing) and cancels pending transfers.
  void abort(std::exception_ptr e) {
    std::string what = "unknown error";
    try {
      if (e) std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = detail::what_of(x);
    } catch (...) {
    }
    publish("rank " + std::to_string(rank()) + " failed: " + what);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_here_ = true;
      stopped_ = true;
      abort_works_locked();
    }
    wake_.notify_all();
    abort_local(e);
  }

 private:
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

  // Throws a copy of the failure `e`: each thread that learns of it gets its own exception
  // object, to which the executor may add its cell as context without touching the others'.
  [[noreturn]] static void throw_copy(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const c10::Error& x) {
      throw c10::Error(x);
    }
  }

  // The rest of a message whose fixed header `fixed` has arrived: the header's tail, then the
  // tensors. Nothing once this process aborted.
  std::optional<Message> receive_rest(const torch::Tensor& fixed, int src, int tag,
                                      const MessageKey& k) {
    std::vector<std::int64_t> words;
    {
      auto cpu = fixed.cpu();
      const auto rest = detail::header_rest(cpu);
      words.assign(cpu.data_ptr<std::int64_t>(), cpu.data_ptr<std::int64_t>() + cpu.numel());
      if (rest > 0) {
        auto more = torch::empty({rest}, fixed.options());
        if (!receive(more, src, tag, k)) return std::nullopt;
        auto m = more.cpu();
        words.insert(words.end(), m.data_ptr<std::int64_t>(), m.data_ptr<std::int64_t>() + rest);
      }
    }
    Message m = detail::decode_header(words, options_.device_);
    std::int64_t bytes = 0;
    for (auto& t : m.tensors) {
      if (t.defined() && t.numel() > 0) {
        if (!receive(t, src, tag, k)) return std::nullopt;
        bytes += static_cast<std::int64_t>(t.nbytes());
      }
    }
    ++messages_received_;
    bytes_received_ += bytes;
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
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout_;
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
      if (wake_.wait_until(lock, deadline) == std::cv_status::timeout &&
          !arrivals_.find(k)->second.done) {
        const std::string stuck =
            "rank " + std::to_string(rank()) + " waited more than " +
            std::to_string(options_.timeout_.count()) + " ms for " + detail::describe(k) +
            " from rank " + std::to_string(src) + "; that rank is stuck or slower than " +
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
      wake_.wait(lock, [&] { return closing_ || !ahead_.empty(); });
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
      wake_.notify_all();
    }
  }

  MailboxTransport& local() {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(local_ != nullptr, "stagewise::C10dTransport: call begin_step(stages, ",
                "micro_batches, skips) before a step's messages");
    return *local_;
  }

  void abort_local(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (local_) local_->abort(e);
  }

  int source_stage(const MessageKey& k) const {
    switch (k.kind) {
      case MessageKind::activation:
        return k.stage - 1;
      case MessageKind::gradient:
        return k.stage + 1;
      case MessageKind::skip:
      case MessageKind::skip_grad:
        TORCH_CHECK(k.skip >= 0 && static_cast<std::size_t>(k.skip) < routes_.size(),
                    "stagewise::C10dTransport: skip ", k.skip, " has no route; pass every skip's ",
                    "(stash stage, pop stage) to the transport, ", routes_.size(), " were given");
        return k.kind == MessageKind::skip ? routes_[static_cast<std::size_t>(k.skip)].stash_stage
                                           : routes_[static_cast<std::size_t>(k.skip)].pop_stage;
    }
    return k.stage;
  }

  // 29 bits: step % 4, kind, receiving stage, micro-batch, skip + 1.
  int tag_of(const MessageKey& k) const {
    TORCH_CHECK(k.stage >= 0 && k.stage < 256 && k.micro >= 0 && k.micro < 4096 && k.skip >= -1 &&
                    k.skip < 31,
                "stagewise::C10dTransport: ", detail::describe(k),
                " is beyond what message tags hold (256 stages, 4096 micro-batches, 31 skips); "
                "use fewer chunks or stages");
    return ((((static_cast<int>(step_.load() % 4) * 4 + static_cast<int>(k.kind)) * 256 + k.stage) *
                 4096 +
             k.micro) *
            32) +
           (k.skip + 1);
  }

  // Receives into `t`; false once aborted here; throws the failure otherwise.
  bool receive(torch::Tensor& t, int src, int tag, const MessageKey& k) {
    auto id = post(t, src, tag, k, std::chrono::steady_clock::now() + options_.timeout_);
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
    // A rank that failed published why before it exited: that is the cause to report. The
    // closed connection can be seen here before the store answers with it, so look a few times.
    const auto until = std::chrono::steady_clock::now() + std::max(3 * options_.poll_,
                                                                   std::chrono::milliseconds(300));
    while (true) {
      if (auto published = read_published()) {
        fail(*published);
        rethrow_failure();
      }
      if (std::chrono::steady_clock::now() > until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    const std::string what = "rank " + std::to_string(peer) + " is gone: its connection closed " +
                             "while rank " + std::to_string(rank()) + " exchanged " +
                             detail::describe(k) + " with it; it crashed, was killed, or exited " +
                             "early (see its output). Transport error: " + detail::what_of(e);
    publish(what);
    fail(what);
    rethrow_failure();
    TORCH_CHECK(false, "stagewise: ", what);
  }

  // Records a failure seen or learnt here and cancels every pending transfer.
  void fail(const std::string& what) {
    std::exception_ptr failure;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_here_) return;
      if (!failure_) {
        try {
          TORCH_CHECK(false, "stagewise: ", what, ". Rank ", rank(), " stops too.");
        } catch (...) {
          failure_ = std::current_exception();
        }
      }
      failure = failure_;
      stopped_ = true;
      abort_works_locked();
    }
    wake_.notify_all();
    abort_local(failure);
  }

  // Tells the other ranks (first writer wins); the store may be gone already.
  void publish(const std::string& what) {
    try {
      const std::vector<std::uint8_t> value(what.begin(), what.end());
      store_->compareSet(abort_key_, {}, value);
    } catch (...) {
    }
  }

  // What a failed rank wrote to the store, if anything (the store may be gone).
  std::optional<std::string> read_published() {
    try {
      if (store_->check({abort_key_})) {
        const auto v = store_->get(abort_key_);
        return std::string(v.begin(), v.end());
      }
    } catch (...) {
    }
    return std::nullopt;
  }

  void abort_works_locked() {
    for (auto& [id, w] : waiting_) w.work->abort();
    for (auto& s : sends_) s.work->abort();
  }

  // Background: another rank's failure in the store, and receives past their deadline.
  void watch() {
    bool store_ok = true;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!closing_) {
      wake_.wait_for(lock, options_.poll_);
      if (closing_ || stopped_) continue;
      std::string stuck;
      const auto now = std::chrono::steady_clock::now();
      for (const auto& [id, w] : waiting_) {
        if (now > w.deadline) {
          stuck = "rank " + std::to_string(rank()) + " waited more than " +
                  std::to_string(options_.timeout_.count()) + " ms for " + detail::describe(w.key) +
                  " from rank " + std::to_string(w.peer) + "; that rank is stuck or slower than " +
                  "the timeout (raise C10dOptions::timeout if its stage is just slow)";
          break;
        }
      }
      if (!stuck.empty()) {
        lock.unlock();
        publish(stuck);
        fail(stuck);
        lock.lock();
        continue;
      }
      if (!store_ok) continue;
      lock.unlock();
      std::optional<std::string> published;
      try {
        if (store_->check({abort_key_})) {
          const auto v = store_->get(abort_key_);
          published.emplace(v.begin(), v.end());
        }
      } catch (...) {
        // Rank 0, which serves the store, has exited; if it died, the Gloo connections to it
        // fail the receives that wait on it, and the deadline bounds the others.
        store_ok = false;
      }
      if (published) fail(*published);
      lock.lock();
    }
  }

  // Background: completes this rank's sends in order, so their tensors are freed early.
  void reap() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return closing_ || !sends_.empty(); });
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
        const std::string what = "rank " + std::to_string(p.peer) +
                                 " is gone: its connection closed while rank " +
                                 std::to_string(rank()) + " sent it " + detail::describe(p.key) +
                                 "; it crashed, was killed, or exited early (see its output). "
                                 "Transport error: " +
                                 *broken;
        lock.unlock();
        if (auto published = read_published()) {
          fail(*published);
        } else {
          publish(what);
          fail(what);
        }
        lock.lock();
      }
      idle_.notify_all();
    }
  }

  PointToPoint group_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::function<int(int)> rank_of_;
  std::vector<schedule::SkipRoute> routes_;
  C10dOptions options_;
  std::string abort_key_;
  std::atomic<std::int64_t> step_{0};
  std::atomic<std::int64_t> messages_sent_{0}, bytes_sent_{0};  // to other ranks
  std::atomic<std::int64_t> messages_received_{0}, bytes_received_{0};
  bool begun_ = false;
  std::unique_ptr<MailboxTransport> local_;  // this step's, between stages of this process

  std::mutex post_;   // one message's sends go out together
  std::mutex mutex_;  // everything below
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<Pending> sends_;
  bool sending_ = false;
  std::map<std::uint64_t, Waiting> waiting_;
  std::uint64_t next_id_ = 0;
  bool stopped_ = false;       // no more transfers: failure, abort here, or closing
  bool aborted_here_ = false;  // abort() was called on this rank
  bool closing_ = false;
  std::exception_ptr failure_;
  std::deque<Ahead> ahead_;                              // posted ahead, not yet received
  std::unordered_map<MessageKey, Arrival> arrivals_;     // expected this step, by key
  std::thread watchdog_;
  std::thread reaper_;
  std::thread receiver_;
};

}  // namespace stagewise::runtime
