#pragma once

#include "stagewise/pipe/detail/format1_save.hpp"
#include "stagewise/pipe/detail/save_format.hpp"
#include "stagewise/pipe/detail/save_index.hpp"

#include <torch/serialize/input-archive.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace stagewise {

/// What a complete save of a pipe (`pipe->save`) says of itself: where it is, its step, and the
/// plan that made it. A save loads under any plan; this is what a restart script reads to pick
/// one and to report what it resumes.
///   if (auto last = sw::latest_save("ckpt")) std::cout << last->dir << " step " << last->step;
struct SaveInfo {
  std::string dir;             ///< the save's directory
  std::int64_t step = 0;       ///< the step given to `save`, which `load` returns
  std::int64_t format = 0;     ///< 2 (any plan loads it) or 1 (only the plan that made it)
  std::int64_t processes = 1;  ///< the processes (ranks) of the job that saved it
  std::int64_t replicas = 1;   ///< its data-parallel replicas (format 2; 1 for format 1)
  std::int64_t stages = 0;     ///< its pipeline stages
};

/// The save in `dir` if it is complete (format 2: its index is there; format 1: every process's
/// rank file is), else nothing; a file it cannot read counts as incomplete.
///   auto info = sw::read_save_info("ckpt/step-100");
inline std::optional<SaveInfo> read_save_info(const std::string& dir) {
  namespace fs = std::filesystem;
  SaveInfo info{.dir = dir};
  try {
    const auto index = detail::save_file(dir, detail::index_name());
    if (fs::exists(index)) {
      torch::serialize::InputArchive a;
      a.load_from(index);
      const auto x = detail::SaveIndex::read(a);
      info.step = x.step;
      info.format = x.format;
      info.processes = x.plan.processes;
      info.replicas = x.plan.replicas;
      info.stages = static_cast<std::int64_t>(x.plan.layers.size());
      return info;
    }
    const auto rank0 = detail::save_file(dir, detail::rank_name(0));
    if (!fs::exists(rank0)) return std::nullopt;
    torch::serialize::InputArchive a, plan;
    a.load_from(rank0);
    c10::IValue v;
    a.read("format", v);
    if (v.toInt() != detail::kFormat1) return std::nullopt;  // format 2 without its index
    a.read("step", v);
    info.step = v.toInt();
    info.format = detail::kFormat1;
    a.read("plan", plan);
    const auto p = detail::Format1Plan::read(plan);
    info.processes = p.processes;
    info.stages = static_cast<std::int64_t>(p.placement.size());
    for (std::int64_t r = 1; r < p.processes; ++r) {
      if (!fs::exists(detail::save_file(dir, detail::rank_name(static_cast<int>(r))))) {
        return std::nullopt;
      }
    }
    return info;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

/// The complete save of the highest step among the directories in `root` (each save in a
/// directory of its own, as `pipe->save("ckpt/step-" + std::to_string(step), ...)` makes them;
/// of two saves of one step, the one whose directory name sorts last), or nothing: what a job
/// restarted after a failure loads, on as many ranks as it now has.
///   auto last = sw::latest_save("ckpt");
///   std::int64_t first = last ? pipe->load(last->dir, optimizer) + 1 : 0;
inline std::optional<SaveInfo> latest_save(const std::string& root) {
  namespace fs = std::filesystem;
  std::optional<SaveInfo> best;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return best;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (!entry.is_directory()) continue;
    auto info = read_save_info(entry.path().string());
    if (info &&
        (!best || info->step > best->step || (info->step == best->step && info->dir > best->dir))) {
      best = std::move(info);
    }
  }
  return best;
}

}  // namespace stagewise
