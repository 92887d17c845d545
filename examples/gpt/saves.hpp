// The run directory of examples/gpt.cpp: the pipe's saves (ckpt-<step>/) and the loss log
// (losses.csv), read back by --resume.
#pragma once

#include "examples/gpt/plot.hpp"

#include <stagewise/pipe/save_info.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace gpt {

/// The complete save (stagewise::read_save_info) of the highest step among `out`'s ckpt-<step>/
/// directories, or "" if none (final/, the run's last save, is for export).
inline std::string latest_save(const std::string& out) {
  namespace fs = std::filesystem;
  std::string best;
  long long best_step = -1;
  if (!fs::is_directory(out)) return best;
  for (const auto& e : fs::directory_iterator(out)) {
    if (e.path().filename().string().rfind("ckpt-", 0) != 0) continue;
    const auto info = stagewise::read_save_info(e.path().string());
    if (info && info->step > best_step) best_step = info->step, best = info->dir;
  }
  return best;
}

/// The split a run trained with (`<out>/balance`: layers per stage), which --resume reuses: a
/// split measured again could differ, and though a save loads into any split, the same split
/// resumes bit for bit (in one process, random layers in several stages draw in their threads'
/// order; docs/distributed.md, "Resume on other ranks").
inline void write_balance(const std::string& out, const std::vector<int64_t>& b) {
  std::ofstream f(out + "/balance");
  TORCH_CHECK(f, "gpt: cannot write '", out, "/balance'");
  for (auto n : b) f << n << "\n";
}

inline std::vector<int64_t> read_balance(const std::string& out) {
  std::ifstream f(out + "/balance");
  TORCH_CHECK(f, "gpt: --resume needs ", out, "/balance (the split of the run to resume)");
  std::vector<int64_t> b;
  for (int64_t n = 0; f >> n;) b.push_back(n);
  return b;
}

inline void write_losses(const std::string& path, const std::vector<LossPoint>& log) {
  std::ofstream out(path);
  TORCH_CHECK(out, "gpt: cannot write '", path, "'");
  out << "step,train,valid\n";
  char line[96];
  for (const auto& p : log) {
    std::snprintf(line, sizeof line, "%lld,%.9g,%.9g\n", (long long)p.step, p.train, p.valid);
    out << line;
  }
}

/// The logged points before step `until` (those a resumed run keeps).
inline std::vector<LossPoint> read_losses(const std::string& path, int64_t until) {
  std::vector<LossPoint> log;
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    LossPoint p;
    long long step = 0;
    if (std::sscanf(line.c_str(), "%lld,%lf,%lf", &step, &p.train, &p.valid) != 3) continue;
    p.step = step;
    if (p.step < until) log.push_back(p);
  }
  return log;
}

}  // namespace gpt
