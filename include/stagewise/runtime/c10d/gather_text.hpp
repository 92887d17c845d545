#pragma once

#include "stagewise/runtime/c10d/group.hpp"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace stagewise::runtime {

/// Every rank's `mine`, in rank order, exchanged through the job's store under `key` (one key per
/// exchange: every rank of the job calls it with the same key, and no call reuses one; over a
/// group inside a larger job, `runtime::subgroup`, every rank of the whole job takes part).
/// Returns on each rank once it has read all of them; the rank serving the store also waits (bounded by `timeout`)
/// until every rank has read them, so it may exit right after, and then deletes the exchange's
/// keys (the store does not grow with the number of exchanges). A rank that has not written its
/// text within `timeout` is an error naming it and `what`, on every rank that waits for it.
///   auto steps = stagewise::runtime::gather_text(c, "job/load/1", std::to_string(step),
///                                                std::chrono::seconds(30), "Pipe::load");
inline std::vector<std::string> gather_text(const Connection& c, const std::string& key,
                                            const std::string& mine,
                                            std::chrono::milliseconds timeout,
                                            const std::string& what) {
  const int world = c.job_world();
  const int me = c.job_rank(c.env.rank);
  auto value_key = [&](int r) { return key + "/" + std::to_string(r); };
  auto read_key = [&](int r) { return key + "/read/" + std::to_string(r); };
  c.store->set(value_key(me), std::vector<std::uint8_t>(mine.begin(), mine.end()));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> out;
  for (int r = 0; r < world; ++r) {
    // Polls with check(): a timed-out Store::wait leaves LibTorch 1.13's TCPStore client
    // expecting a reply that never comes.
    while (!c.store->check({value_key(r)})) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "stagewise::distributed: rank ",
                  me, " waited ", timeout.count(), " ms for rank ", r, " to reach ", what,
                  "; every rank must call it (a rank that exited or failed earlier never will)");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const auto v = c.store->get(value_key(r));
    out.emplace_back(v.begin(), v.end());
  }
  c.store->set(read_key(me), std::vector<std::uint8_t>{1});
  if (c.serves_store) {
    std::vector<std::string> all;
    for (int r = 0; r < world; ++r) all.push_back(read_key(r));
    bool read = false;
    while (!(read = c.store->check(all)) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (int r = 0; r < world && read; ++r) {  // nobody reads them again
      c.store->deleteKey(value_key(r));
      c.store->deleteKey(read_key(r));
    }
  }
  return out;
}

}  // namespace stagewise::runtime
