#pragma once

// Clipping by the whole model's gradient norm on a pipe whose stages run in several processes
// (PipeOverImpl::clip_grad_norm_step): every process's per-parameter norms, gathered and put in
// stage order, so that every process totals the same list (the one-process pipe's) and computes
// the same clip coefficient; and the refusal of a clip that totals one process's norms only.

#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/runtime/processes.hpp"
#include "stagewise/runtime/stage_runtime.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

// A fused step whose clip norm pass totals this process's norms only (optim::clip_grad_norm_step
// without the pipe) is refused on a pipe over several processes: each would clip by its own part.
inline void refuse_local_clip(optim::FusedStep& fused, const runtime::Processes& here,
                              const std::string& where) {
  TORCH_CHECK(here.count == 1 || !FusedStepAccess::measuring_alone(fused), where,
              ": optim::clip_grad_norm_step around a pipe whose stages run on ", here.count,
              " processes would clip each by its own stages' gradient norm; call "
              "pipe->clip_grad_norm_step(fused, closure, max_norm) instead (the same arguments), "
              "which clips every rank by the whole model's norm");
}

// A double as text, exactly ("%a"), and back.
inline std::string exact_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", v);
  return buf;
}
inline double exact_value(const std::string& s) {
  return std::strtod(s.c_str(), nullptr);
}

// The NormGather of a clip on a pipe: `here` (the transport's processes), `stages` the pipe's
// (null: another process's), `fused` the fused step's parameters, `gather`
// the transport's gather (every process's text in rank order). Null in one process: the fused
// step's own order is the pipe's. Otherwise each process sends, per stage it runs, the norms of
// the stage's parameters (in the stage's parameter order, those in the fused step with a
// gradient), exactly; every process then takes each stage's norms from the first process (in rank
// order) that runs it (with data-parallel replicas: the first replica's, whose averaged gradients
// every replica shares) and lists them in stage order: the list a one-process pipe's fused step
// over pipe->parameters() totals. max_norm and norm_type must be the same on every process.
inline optim::NormGather stage_norm_gather(
    const runtime::Processes& here,
    const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages,
    std::vector<torch::Tensor> fused,
    std::function<std::vector<std::string>(const std::string&, const std::string&)> gather,
    double max_norm, double norm_type, std::string where) {
  if (here.count == 1) return nullptr;
  std::vector<std::vector<torch::Tensor>> stage_params(stages.size());  // empty: not here
  for (std::size_t j = 0; j < stages.size(); ++j) {
    if (stages[j] && stages[j]->spec.module) stage_params[j] = stages[j]->spec.module->parameters();
  }
  return [here, stage_params = std::move(stage_params), fused = std::move(fused),
          gather = std::move(gather), max_norm, norm_type,
          where = std::move(where)](const std::vector<torch::Tensor>& mine) {
    // Each fused parameter's place in this process's stages.
    std::map<const void*, std::size_t> index;  // TensorImpl -> fused index
    for (std::size_t i = 0; i < fused.size(); ++i) index[fused[i].unsafeGetTensorImpl()] = i;
    std::size_t placed = 0;
    std::ostringstream text;
    text << exact_text(max_norm) << " " << exact_text(norm_type) << "\n";
    for (std::size_t j = 0; j < stage_params.size(); ++j) {
      if (!here.runs(j)) continue;
      text << j;
      for (const auto& p : stage_params[j]) {
        auto it = index.find(p.unsafeGetTensorImpl());
        if (it == index.end()) continue;  // not stepped by this fused step: not clipped either
        ++placed;
        const auto& n = mine.at(it->second);
        if (!n.defined()) continue;  // no gradient this step
        text << " " << static_cast<int>(n.scalar_type()) << ":"
             << exact_text(n.detach().to(torch::kCPU, torch::kDouble).item<double>());
      }
      text << "\n";
    }
    std::string mine_text = text.str();
    if (placed != fused.size()) {
      // Sent in place of the norms, so that every rank fails with it rather than waiting.
      mine_text = "!the fused step has " + std::to_string(fused.size() - placed) + " of its " +
                  std::to_string(fused.size()) +
                  " parameters outside this rank's stages; build it over pipe->parameters() "
                  "(or a part of them)";
    }
    const auto all = gather("clip_grad_norm_step", mine_text);
    for (std::size_t r = 0; r < all.size(); ++r) {
      TORCH_CHECK(all[r].empty() || all[r][0] != '!', where, ": on rank ", r, ", ",
                  all[r].substr(1));
    }
    // Stage j's norms, from the first rank that runs it.
    std::vector<std::string> stage_text(stage_params.size());
    std::vector<bool> found(stage_params.size(), false);
    for (std::size_t r = 0; r < all.size(); ++r) {
      std::istringstream in(all[r]);
      std::string line;
      std::getline(in, line);
      std::istringstream head(line);
      std::string m, t;
      head >> m >> t;
      TORCH_CHECK(exact_value(m) == max_norm && exact_value(t) == norm_type, where, ": rank ", r,
                  " clips with max_norm ", exact_value(m), " and norm_type ", exact_value(t),
                  " but this rank with ", max_norm, " and ", norm_type,
                  "; every rank must pass the same");
      while (std::getline(in, line)) {
        std::istringstream s(line);
        std::size_t j = 0;
        s >> j;
        TORCH_CHECK(j < stage_params.size(), where, ": rank ", r, " sent the norms of stage ", j,
                    " of a pipe of ", stage_params.size(), " stages");
        if (found[j]) continue;
        found[j] = true;
        std::getline(s, stage_text[j]);
      }
    }
    std::vector<torch::Tensor> norms;
    for (std::size_t j = 0; j < stage_params.size(); ++j) {
      TORCH_CHECK(found[j], where, ": no rank sent the gradient norms of stage ", j);
      std::istringstream s(stage_text[j]);
      std::string entry;
      while (s >> entry) {
        const auto colon = entry.find(':');
        const auto dtype = static_cast<c10::ScalarType>(std::stoi(entry.substr(0, colon)));
        norms.push_back(
            torch::full({}, exact_value(entry.substr(colon + 1)), torch::kDouble).to(dtype));
      }
    }
    return norms;
  };
}

}  // namespace stagewise::detail
