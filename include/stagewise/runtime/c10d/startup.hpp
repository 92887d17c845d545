#pragma once

#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/gather_text.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/options.hpp"
#include "stagewise/runtime/stage_signature.hpp"

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/types.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
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
  // Every rank reads every rank's signatures, then compares them with rank 0's, so that all
  // report the same first difference. gather_text keeps the rank serving the store until every
  // rank has read them: it may start its first step, and fail or be killed there, only once no
  // rank still needs the store to start (a rank that lost the store in between would report the
  // store's raw socket error from its constructor instead of the step's failure).
  std::vector<std::vector<std::string>> all;
  for (const auto& text : gather_text(c, key, mine, timeout,
                                      "the model check (every rank must construct the pipe)")) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    all.push_back(std::move(lines));
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

/// Checks, before any step, that every rank sharded the optimizer state alike (`sharding`:
/// `GradientReducer::sharding()`, which names the owner of every parameter): each rank publishes
/// its description in the store, and one that differs from rank 0's fails every rank, naming both
/// and `fix` (the options to set alike). A rank of another stagewise build could own other
/// parameters; its steps would skip some and step others twice.
///   stagewise::runtime::check_same_sharding(c, reducer.sharding(), "job/shard", 30s,
///                                           "stagewise::distributed::DataParallel",
///                                           "DataParallelOptions().shard_optimizer_state(...)");
inline void check_same_sharding(const Connection& c, const std::string& sharding,
                                const std::string& key, std::chrono::milliseconds timeout,
                                const std::string& who, const std::string& fix) {
  const auto all =
      gather_text(c, key, sharding, timeout, "the sharding check (every rank must construct it)");
  for (std::size_t r = 1; r < all.size(); ++r) {
    TORCH_CHECK(all[r] == all[0], who, ": ranks 0 and ", r,
                " shard the optimizer state differently: rank 0 {", all[0], "}, rank ", r, " {",
                all[r], "}; give every rank the same ", fix,
                " and the same model (and stagewise build)");
  }
}

namespace detail {
// Tests only: a version other than 0 is announced at start-up instead of kWireVersion, as a rank
// of another stagewise build would (tests/distributed/wire_test.cpp).
inline std::int64_t wire_version_for_tests = 0;
}  // namespace detail

/// What this rank's transport puts on the wire, as the ranks compare it at start-up
/// (`check_same_wire`): a rank of another stagewise or LibTorch build, or with a transport on
/// another kind of device, would misread the others' messages, or send one longer than the
/// receive posted for it (which ends the receiving process inside Gloo).
///   auto mine = stagewise::runtime::wire_format(stagewise::runtime::C10dOptions());
struct WireFormat {
  std::int64_t version = detail::kWireVersion;
  std::int64_t inline_bytes = 0;  // tensor bytes a message's first transfer carries
  std::string layout;             // the header's layout, in words
  std::string libtorch;           // the LibTorch version compiled against
  std::string device;             // where received tensors are allocated: cpu (Gloo), cuda (NCCL)
  std::string dtypes;             // each dtype a message may carry: its number and element size

  /// Its fields as (name, value), in the order errors name them.
  std::vector<std::pair<std::string, std::string>> fields() const {
    return {{"wire version", std::to_string(version)},
            {"inline room", std::to_string(inline_bytes) + " bytes"},
            {"header layout", layout},
            {"LibTorch", libtorch},
            {"transport device", device},
            {"dtype codes", dtypes}};
  }
};

/// The wire format of a C10dTransport with `options` in this build.
inline WireFormat wire_format(const C10dOptions& options) {
  WireFormat w;
  if (detail::wire_version_for_tests != 0) w.version = detail::wire_version_for_tests;
  w.inline_bytes = options.device().is_cpu() ? detail::kInlineBytes : 0;
  w.layout = detail::kHeaderLayout;
  w.libtorch = TORCH_VERSION;
  w.device = c10::DeviceTypeName(options.device().type(), /*lower_case=*/true);
  for (std::int64_t d = 0; d < static_cast<std::int64_t>(c10::ScalarType::NumOptions); ++d) {
    if (!detail::sendable_dtype(d)) continue;
    const auto t = static_cast<c10::ScalarType>(d);
    w.dtypes += (w.dtypes.empty() ? "" : " ") + std::string(c10::toString(t)) + "=" +
                std::to_string(d) + "/" + std::to_string(c10::elementSize(t));
  }
  return w;
}

/// Checks, before the first message, that every rank speaks the same wire format: each rank
/// publishes `mine` (`wire_format(options)`) in the store and compares every rank's with rank
/// 0's. A difference throws c10::Error on every rank, naming both ranks and each field that
/// differs with both values. `key` tells apart several pipes in one job. distributed::Pipe runs
/// it; a program that builds C10dTransport itself runs it once on every rank before the first.
///   stagewise::runtime::check_same_wire(c, stagewise::runtime::wire_format(options));
inline void check_same_wire(const Connection& c, const WireFormat& mine,
                            const std::string& key = "stagewise/wire",
                            std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  std::string text;
  for (const auto& [name, value] : mine.fields()) text += name + "=" + value + "\n";
  // Every rank reads every rank's, and the rank serving the store waits until all have read
  // (gather_text), as check_same_model does.
  const auto all = gather_text(c, key, text, timeout, "the wire format check");
  auto fields_of = [](const std::string& t) {
    std::vector<std::pair<std::string, std::string>> out;
    std::istringstream in(t);
    for (std::string line; std::getline(in, line);) {
      const auto eq = line.find('=');
      out.emplace_back(line.substr(0, eq), eq == std::string::npos ? "" : line.substr(eq + 1));
    }
    return out;
  };
  const auto reference = fields_of(all[0]);
  for (int r = 1; r < c.env.world_size; ++r) {
    const auto other = fields_of(all[static_cast<std::size_t>(r)]);
    std::string differences;
    for (std::size_t f = 0; f < std::max(reference.size(), other.size()); ++f) {
      const auto field = [&](const auto& v) {
        return f < v.size() ? v[f] : std::pair<std::string, std::string>{"?", "nothing"};
      };
      const auto [name, ours] = field(reference);
      const auto theirs = field(other).second;
      if (ours == theirs) continue;
      differences += (differences.empty() ? "" : "; ") + name + " is " + ours + " on rank 0 but " +
                     theirs + " on rank " + std::to_string(r);
    }
    TORCH_CHECK(differences.empty(), "stagewise::distributed: ranks 0 and ", r,
                " speak different wire formats: ", differences,
                ". Every rank must run the same stagewise and LibTorch build with the same "
                "transport device (Gloo on CPU, or NCCL on GPU), or they would misread each "
                "other's messages");
  }
}

}  // namespace stagewise::runtime
