#pragma once

#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/transport.hpp"

#include <c10/util/Exception.h>

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// The in-process transport: one mailbox slot per message of a step (activations, gradients, skip
/// tensors and skip gradients), one mutex, one condition variable per receiving stage, one abort.
/// Slots are preallocated, so sending and receiving allocate nothing beyond the message itself.
///   MailboxTransport mail(/*stages=*/2, /*micro_batches=*/4, /*skips=*/0);
///   mail.send({schedule::TransferKind::activation, 1, 0}, Message{{x}});
///   auto m = mail.recv({schedule::TransferKind::activation, 1, 0});  // nullopt once aborted
class MailboxTransport {
 public:
  MailboxTransport(int stages, int micro_batches, int skips)
      : stages_(stages),
        m_(micro_batches),
        skips_(skips),
        slots_(static_cast<std::size_t>(stages) * micro_batches * (2 + 2 * skips)),
        wake_(static_cast<std::size_t>(stages)) {}

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

  int stages_;
  int m_;
  int skips_;
  mutable std::mutex mutex_;
  std::vector<std::optional<Message>> slots_;
  std::vector<std::condition_variable> wake_;
  bool aborted_ = false;
  std::exception_ptr error_;
};

static_assert(transport<MailboxTransport>);

}  // namespace stagewise::runtime
