#pragma once

#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/stage_signature.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace stagewise::runtime {

/// Checks, before any step, that the job has one rank per worker of the plan: `workers` ranks,
/// as many as the schedule puts the stages on.
///   stagewise::runtime::check_world_size(c, 8, 4);  // interleaved{2}: 8 stages, 4 ranks
inline void check_world_size(const Connection& c, int stages, int workers) {
  TORCH_CHECK(c.env.world_size == workers, "stagewise::distributed: the pipe has ", stages,
              " stages on ", workers, " workers, one per rank, but WORLD_SIZE is ",
              c.env.world_size, "; start ", workers, " ranks (tools/launch -n ", workers,
              "), or change the balance or the schedule's virtual stages to fit ", c.env.world_size,
              " ranks");
}

/// Checks, before any step, that every rank built the same model: each rank publishes its
/// signature of every stage (`signatures[j]` for stage j, see `stage_signature`) in the store and
/// compares them with every other rank's. A difference throws c10::Error on every rank, naming
/// the rank, the stage and both signatures. `key` tells apart several pipes in one job.
///   stagewise::runtime::check_same_model(c, {stage_signature(*s0), stage_signature(*s1)});
inline void check_same_model(const Connection& c, const std::vector<std::string>& signatures,
                             const std::string& key = "stagewise/model",
                             std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  std::string mine;
  for (const auto& s : signatures) mine += s + "\n";
  c.store->set(key + "/" + std::to_string(c.env.rank),
               std::vector<std::uint8_t>(mine.begin(), mine.end()));
  auto lines_of = [&](int r) {
    const std::string k = key + "/" + std::to_string(r);
    // Polls with check(): a timed-out Store::wait leaves LibTorch 1.13's TCPStore client
    // expecting a reply that never comes.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!c.store->check({k})) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "stagewise::distributed: rank ", r,
                  " did not describe its model within ", timeout.count(),
                  " ms; every rank must construct the distributed pipe");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const auto v = c.store->get(k);
    std::vector<std::string> lines;
    std::istringstream in(std::string(v.begin(), v.end()));
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  };
  // Every rank reads every rank's signatures first, then compares them with rank 0's, so that
  // all report the same first difference.
  std::vector<std::vector<std::string>> all;
  for (int r = 0; r < c.env.world_size; ++r) all.push_back(lines_of(r));
  // The rank serving the store waits (bounded) until every rank has read them: it may start its
  // first step, and fail or be killed there, only once no rank still needs the store to start.
  // A rank that lost the store in between would otherwise report the store's raw socket error
  // from its constructor instead of the step's failure.
  c.store->set(key + "/read/" + std::to_string(c.env.rank), std::vector<std::uint8_t>{1});
  if (c.serves_store) {
    std::vector<std::string> read;
    for (int r = 0; r < c.env.world_size; ++r) read.push_back(key + "/read/" + std::to_string(r));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!c.store->check(read) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  const auto& reference = all[0];
  for (int r = 1; r < c.env.world_size; ++r) {
    const auto& other = all[static_cast<std::size_t>(r)];
    TORCH_CHECK(reference.size() == other.size(), "stagewise::distributed: rank 0 built ",
                reference.size(), " stages but rank ", r, " built ", other.size(),
                "; every rank must build the same model and balance");
    for (std::size_t j = 0; j < reference.size(); ++j) {
      TORCH_CHECK(reference[j] == other[j], "stagewise::distributed: ranks 0 and ", r,
                  " built different stage ", j, ": rank 0 has {", reference[j], "}, rank ", r,
                  " has {", other[j], "}; every rank must build the same model and balance");
    }
  }
}

}  // namespace stagewise::runtime
