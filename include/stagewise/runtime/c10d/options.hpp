#pragma once

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

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

  /// The most bytes one message from another rank may carry (default 16 GiB): a header that
  /// claims more is refused before anything is allocated, naming the sender (a corrupt or foreign
  /// message, e.g. another job on the same port).
  C10dOptions& max_message_bytes(std::int64_t bytes) {
    max_message_bytes_ = bytes;
    return *this;
  }

  /// What the setters above set, read back (as `PipeOptions`' getters are).
  std::chrono::milliseconds timeout() const { return timeout_; }
  std::chrono::milliseconds poll() const { return poll_; }
  const torch::Device& device() const { return device_; }
  const std::string& prefix() const { return prefix_; }
  std::int64_t max_message_bytes() const { return max_message_bytes_; }

 private:
  std::chrono::milliseconds timeout_{30000};
  std::chrono::milliseconds poll_{100};
  torch::Device device_{torch::kCPU};
  std::string prefix_{"stagewise"};
  std::int64_t max_message_bytes_ = std::int64_t{16} << 30;
};

}  // namespace stagewise::runtime
