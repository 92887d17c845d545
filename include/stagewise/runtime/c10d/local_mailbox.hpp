#pragma once

#include "stagewise/runtime/message.hpp"

#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

namespace stagewise::runtime::detail {

// Messages between stages of one process, by key: `send` stores, `recv` waits for its key.
// Stands in for the in-process message layer until the c10d transport composes with it.
class LocalMailbox {
 public:
  void send(const MessageKey& k, Message m) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) return;
      slots_.insert_or_assign(index(k), std::move(m));
    }
    wake_.notify_all();
  }

  std::optional<Message> recv(const MessageKey& k) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto i = index(k);
    wake_.wait(lock, [&] { return aborted_ || slots_.count(i) != 0; });
    if (aborted_) return std::nullopt;
    auto node = slots_.extract(i);
    return std::move(node.mapped());
  }

  void abort(std::exception_ptr) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_ = true;
    }
    wake_.notify_all();
  }

 private:
  using key = std::tuple<int, int, int, int>;
  static key index(const MessageKey& k) {
    return {static_cast<int>(k.kind), k.stage, k.micro, k.skip};
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<key, Message> slots_;
  bool aborted_ = false;
};

}  // namespace stagewise::runtime::detail
