#pragma once

#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/transport.hpp"
#include "stagewise/runtime/stream.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace stagewise::distributed::detail {

// Small per-step values every rank needs (the number of micro-batches, the loss), passed through
// the store: one rank sets the key, the others wait for it, watching the abort key meanwhile.

inline void publish_bytes(const runtime::Connection& c, const std::string& key,
                          std::vector<std::uint8_t> bytes) {
  c.store->set(key, bytes);
}

inline std::vector<std::uint8_t> wait_bytes(const runtime::Connection& c, const std::string& key,
                                            const runtime::C10dOptions& o, int rank, int from,
                                            const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + o.timeout_;
  const std::string abort_key = o.prefix_ + "/abort";
  // Polls with check(): a timed-out Store::wait leaves LibTorch 1.13's TCPStore client expecting
  // a reply that never comes. The sleep grows from 20 us to 1 ms, so a value that is nearly
  // there (the loss at the end of a step) is seen at once.
  auto pause = std::chrono::microseconds(20);
  for (int polls = 0;; ++polls) {
    bool aborted = false;
    std::string published;
    try {
      if (c.store->check({key})) return c.store->get(key);
      if (polls % 64 == 63 && c.store->check({abort_key})) {
        const auto v = c.store->get(abort_key);
        published.assign(v.begin(), v.end());
        aborted = true;
      }
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "stagewise: rank ", rank, " lost the rendezvous store (served by rank 0) ",
                  "while waiting for ", what, " from rank ", from,
                  "; rank 0 exited or was killed (see its output): ", runtime::detail::what_of(e));
    }
    TORCH_CHECK(!aborted, "stagewise: ", published, ". Rank ", rank, " stops too.");
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "stagewise: rank ", rank,
                " waited more than ", o.timeout_.count(), " ms for ", what, " from rank ", from,
                "; that rank is stuck or slower than the timeout (raise the timeout if it is just "
                "slow)");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

inline void publish_int(const runtime::Connection& c, const std::string& key, int value) {
  const std::string s = std::to_string(value);
  publish_bytes(c, key, std::vector<std::uint8_t>(s.begin(), s.end()));
}

inline int wait_int(const runtime::Connection& c, const std::string& key,
                    const runtime::C10dOptions& o, int rank, int from) {
  const auto v = wait_bytes(c, key, o, rank, from, "the step's number of micro-batches");
  return std::stoi(std::string(v.begin(), v.end()));
}

// A 0-dim tensor, bit for bit: its dtype, then its bytes.
inline void publish_tensor(const runtime::Connection& c, const std::string& key,
                           const torch::Tensor& t) {
  const auto cpu = runtime::copy_to(t.detach(), torch::kCPU).contiguous();
  std::vector<std::uint8_t> bytes(1 + cpu.nbytes());
  bytes[0] = static_cast<std::uint8_t>(cpu.scalar_type());
  std::memcpy(bytes.data() + 1, cpu.data_ptr(), cpu.nbytes());
  publish_bytes(c, key, std::move(bytes));
}

inline torch::Tensor wait_tensor(const runtime::Connection& c, const std::string& key,
                                 const runtime::C10dOptions& o, int rank, int from) {
  const auto v = wait_bytes(c, key, o, rank, from, "the step's loss");
  auto t = torch::empty({}, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(v.at(0))));
  TORCH_CHECK(v.size() == 1 + t.nbytes(), "stagewise: the loss from rank ", from,
              " is garbled; every rank must run the same program");
  std::memcpy(t.data_ptr(), v.data() + 1, t.nbytes());
  return t;
}

// Drops an old step's keys (every rank is past that step by now).
inline void forget_step(const runtime::Connection& c, const std::string& key, bool first,
                        bool last) {
  try {
    if (first) c.store->deleteKey(key + "/m");
    if (last) c.store->deleteKey(key + "/loss");
  } catch (const std::exception&) {
  }
}

}  // namespace stagewise::distributed::detail
