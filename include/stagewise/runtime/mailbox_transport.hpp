#pragma once

#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/transport.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// The in-process transport: one mailbox slot per message of a step (activations, gradients, skip
/// tensors and skip gradients), one mutex, one condition variable per receiving stage, one abort.
/// Slots are preallocated, so sending and receiving allocate nothing beyond the message itself.
/// A `pipe_transport`: `stagewise::Pipe` keeps one and begins each step on it (the slots are
/// reused while the step's shape stays the same); nothing crosses processes, so `share` returns
/// its value and `traffic` stays 0.
///   MailboxTransport mail(/*stages=*/2, /*micro_batches=*/4, /*skips=*/0);
///   mail.send({schedule::TransferKind::activation, 1, 0}, Message{{x}});
///   auto m = mail.recv({schedule::TransferKind::activation, 1, 0});  // nullopt once aborted
class MailboxTransport {
 public:
  /// A transport for no step yet: call begin_step first.
  MailboxTransport() = default;
  MailboxTransport(int stages, int micro_batches, int skips) {
    reset(stages, micro_batches, skips);
  }

  /// Starts a step of `plan` with `routes.size()` skips: every slot empty, no abort, no error.
  /// Called before the step's workers run (not while a step is under way).
  void begin_step(const schedule::Plan& plan, const std::vector<schedule::SkipRoute>& routes) {
    reset(plan.stages, plan.micro_batches, static_cast<int>(routes.size()));
  }

  /// Every stage is in this process: `value` is the value (`from` and `index` name it for
  /// transports between processes).
  torch::Tensor share(const torch::Tensor& value, int /*from*/, int /*index*/) { return value; }

  /// Every stage is in this process, and the step's workers have finished: nothing to wait for.
  void end_step() {}

  /// Nothing crosses processes.
  Traffic traffic() const { return {}; }

  /// One process runs every stage.
  Processes processes() const { return {}; }

  /// One process: its own text is all there is.
  std::vector<std::string> gather(const std::string& /*what*/, const std::string& mine) {
    return {mine};
  }

  /// One process: its own numbers are all there are (`value_gathering_transport`).
  std::vector<torch::Tensor> gather_values(const std::string& /*what*/,
                                           const torch::Tensor& values) {
    return {values};
  }

  /// Leaves `message` for the receiver of `key`; never blocks on the receiver.
  void send(const MessageKey& key, Message message) {
    auto& slot = slots_[index(key)];
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slot.emplace(std::move(message));
    }
    wake_[static_cast<std::size_t>(key.stage)].notify_all();
  }

  /// Waits for the message of `key` and takes it; std::nullopt once the step was aborted.
  std::optional<Message> recv(const MessageKey& key) {
    auto& slot = slots_[index(key)];
    std::unique_lock<std::mutex> lock(mutex_);
    wake_[static_cast<std::size_t>(key.stage)].wait(lock,
                                                    [&] { return aborted_ || slot.has_value(); });
    if (!slot) return std::nullopt;
    std::optional<Message> out = std::move(slot);
    slot.reset();
    return out;
  }

  /// Ends the step: every receiver, waiting or later, gets std::nullopt. Keeps the first error.
  void abort(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = e;
      aborted_ = true;
    }
    for (auto& cv : wake_) cv.notify_all();
  }

  /// The first error given to abort (null if none); read after every worker finished.
  std::exception_ptr error() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  std::size_t index(const MessageKey& k) const {
    const bool skip =
        k.kind == schedule::TransferKind::skip || k.kind == schedule::TransferKind::skip_grad;
    TORCH_CHECK(k.stage >= 0 && k.stage < stages_ && k.micro >= 0 && k.micro < m_ &&
                    (!skip || (k.skip >= 0 && k.skip < skips_)),
                "stagewise: a message for stage ", k.stage, ", micro-batch ", k.micro, ", skip ",
                k.skip, " is outside this step's ", stages_, " stages, ", m_, " micro-batches and ",
                skips_, " skips; build the transport for the plan it carries");
    const std::size_t cell = static_cast<std::size_t>(k.stage) * m_ + k.micro;
    const std::size_t per_cell = 2 + 2 * static_cast<std::size_t>(skips_);
    std::size_t offset = 0;
    switch (k.kind) {
      case schedule::TransferKind::activation:
        offset = 0;
        break;
      case schedule::TransferKind::gradient:
        offset = 1;
        break;
      case schedule::TransferKind::skip:
        offset = 2 + static_cast<std::size_t>(k.skip);
        break;
      case schedule::TransferKind::skip_grad:
        offset = 2 + skips_ + static_cast<std::size_t>(k.skip);
        break;
    }
    return cell * per_cell + offset;
  }

  void reset(int stages, int micro_batches, int skips) {
    const auto slots = static_cast<std::size_t>(stages) * micro_batches * (2 + 2 * skips);
    if (stages != stages_ || slots != slots_.size()) {
      slots_ = std::vector<std::optional<Message>>(slots);
      wake_ = std::vector<std::condition_variable>(static_cast<std::size_t>(stages));
    } else {
      for (auto& slot : slots_) slot.reset();  // left by a failed step
    }
    stages_ = stages;
    m_ = micro_batches;
    skips_ = skips;
    aborted_ = false;
    error_ = nullptr;
  }

  int stages_ = 0;
  int m_ = 0;
  int skips_ = 0;
  mutable std::mutex mutex_;
  std::vector<std::optional<Message>> slots_;
  std::vector<std::condition_variable> wake_;
  bool aborted_ = false;
  std::exception_ptr error_;
};

static_assert(pipe_transport<MailboxTransport>);

}  // namespace stagewise::runtime
