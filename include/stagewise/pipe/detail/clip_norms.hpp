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
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
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

// What each process sends in a clip's norm gather, as float64 numbers (exact for every norm's
// dtype): max_norm, norm_type, how many of the fused step's parameters lie outside this
// process's stages, how many it has; then per stage it runs, the stage's index j, the count k of
// its norms and k triples (the parameter's place in the stage, dtype code, norm), in the stage's
// parameter order.
constexpr std::int64_t kNormHeader = 4;

// This process's numbers: `stage_params[j]` stage j's parameters (empty: not here), `fused` the
// fused step's, `mine` their norms (undefined: no gradient this step, not sent).
inline torch::Tensor norm_values(const runtime::Processes& here,
                                 const std::vector<std::vector<torch::Tensor>>& stage_params,
                                 const std::vector<torch::Tensor>& fused,
                                 const std::vector<torch::Tensor>& mine, double max_norm,
                                 double norm_type) {
  // Each fused parameter's place in this process's stages.
  std::map<const void*, std::size_t> index;  // TensorImpl -> fused index
  for (std::size_t i = 0; i < fused.size(); ++i) index[fused[i].unsafeGetTensorImpl()] = i;
  std::size_t placed = 0;
  std::vector<double> v{max_norm, norm_type, 0.0, static_cast<double>(fused.size())};
  for (std::size_t j = 0; j < stage_params.size(); ++j) {
    if (!here.runs(j)) continue;
    v.push_back(static_cast<double>(j));
    const std::size_t count_at = v.size();
    v.push_back(0.0);
    for (std::size_t q = 0; q < stage_params[j].size(); ++q) {
      auto it = index.find(stage_params[j][q].unsafeGetTensorImpl());
      if (it == index.end()) continue;  // not stepped by this fused step: not clipped either
      ++placed;
      const auto& n = mine.at(it->second);
      if (!n.defined()) continue;  // no gradient this step (or, sharded, another replica's)
      v.push_back(static_cast<double>(q));
      v.push_back(static_cast<double>(static_cast<int>(n.scalar_type())));
      v.push_back(n.detach().to(torch::kCPU, torch::kDouble).item<double>());
      v[count_at] += 1.0;
    }
  }
  // Every rank then fails with it rather than clipping by a part.
  v[2] = static_cast<double>(fused.size() - placed);
  return torch::tensor(v, torch::kDouble);
}

// The norms to total from every process's numbers (`all`, in rank order): each parameter's from
// the first process that sent it (replicas that share averaged gradients all send it; sharded,
// only its owner has it), in stage order and, within a stage, parameter order; every refusal on
// every process alike.
inline std::vector<torch::Tensor> stage_norms(const std::vector<torch::Tensor>& all,
                                             std::size_t stages, double max_norm,
                                             double norm_type, const std::string& where) {
  std::vector<const double*> at(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(all[r].scalar_type() == torch::kDouble && all[r].numel() >= kNormHeader, where,
                ": rank ", r, "'s gradient norms are garbled; every rank must run the same program");
    at[r] = all[r].data_ptr<double>();
  }
  for (std::size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(at[r][2] == 0, where, ": on rank ", r, ", the fused step has ",
                static_cast<std::int64_t>(at[r][2]), " of its ",
                static_cast<std::int64_t>(at[r][3]),
                " parameters outside this rank's stages; build it over pipe->parameters() (or a "
                "part of them)");
  }
  // Per stage: each parameter's place -> (dtype code, norm), from the first rank that sent it.
  std::vector<std::map<std::int64_t, std::pair<int, double>>> found(stages);
  std::vector<char> sent(stages, 0);
  for (std::size_t r = 0; r < all.size(); ++r) {
    const double* v = at[r];
    TORCH_CHECK(v[0] == max_norm && v[1] == norm_type, where, ": rank ", r,
                " clips with max_norm ", v[0], " and norm_type ", v[1], " but this rank with ",
                max_norm, " and ", norm_type, "; every rank must pass the same");
    const std::int64_t n = all[r].numel();
    for (std::int64_t i = kNormHeader; i < n;) {
      const auto j = static_cast<std::int64_t>(v[i]);
      const auto k = i + 1 < n ? static_cast<std::int64_t>(v[i + 1]) : -1;
      TORCH_CHECK(k >= 0 && i + 2 + 3 * k <= n, where, ": rank ", r,
                  "'s gradient norms are garbled; every rank must run the same program");
      TORCH_CHECK(j >= 0 && static_cast<std::size_t>(j) < stages, where, ": rank ", r,
                  " sent the norms of stage ", j, " of a pipe of ", stages, " stages");
      sent[static_cast<std::size_t>(j)] = 1;
      for (std::int64_t e = 0; e < k; ++e) {
        const double* t = v + i + 2 + 3 * e;
        found[static_cast<std::size_t>(j)].emplace(static_cast<std::int64_t>(t[0]),
                                                   std::make_pair(static_cast<int>(t[1]), t[2]));
      }
      i += 2 + 3 * k;
    }
  }
  std::vector<torch::Tensor> norms;
  for (std::size_t j = 0; j < stages; ++j) {
    TORCH_CHECK(sent[j] != 0, where, ": no rank sent the gradient norms of stage ", j);
    for (const auto& [q, norm] : found[j]) {
      const auto dtype = static_cast<c10::ScalarType>(norm.first);
      norms.push_back(torch::full({}, norm.second, torch::kDouble).to(dtype));
    }
  }
  return norms;
}

// The NormGather of a clip on a pipe: `here` (the transport's processes), `stages` the pipe's
// (null: another process's), `fused` the fused step's parameters, `gather` the transport's
// `runtime::gather_values` (every process's numbers in rank order; over a process group, not a
// store, for C10dTransport). Null in one process: the fused step's own order is the pipe's.
// Otherwise each process sends, per stage it runs, the norms of the stage's parameters (in the
// stage's parameter order, those in the fused step with a gradient), exactly; every process then
// takes each parameter's norm from the first process (in rank order) that sent it (with
// data-parallel replicas: the first replica's, whose averaged gradients every replica shares;
// with sharded state, its owner's, the only one that has it) and lists them in stage order: the
// list a one-process pipe's fused step over pipe->parameters() totals. max_norm and norm_type
// must be the same on every process.
inline optim::NormGather stage_norm_gather(
    const runtime::Processes& here,
    const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages,
    std::vector<torch::Tensor> fused,
    std::function<std::vector<torch::Tensor>(const std::string&, const torch::Tensor&)> gather,
    double max_norm, double norm_type, std::string where) {
  if (here.count == 1) return nullptr;
  std::vector<std::vector<torch::Tensor>> stage_params(stages.size());  // empty: not here
  for (std::size_t j = 0; j < stages.size(); ++j) {
    if (stages[j] && stages[j]->spec.module) stage_params[j] = stages[j]->spec.module->parameters();
  }
  return [here, stage_params = std::move(stage_params), fused = std::move(fused),
          gather = std::move(gather), max_norm, norm_type,
          where = std::move(where)](const std::vector<torch::Tensor>& mine) {
    const auto all = gather("clip_grad_norm_step",
                            norm_values(here, stage_params, fused, mine, max_norm, norm_type));
    return stage_norms(all, stage_params.size(), max_norm, norm_type, where);
  };
}

}  // namespace stagewise::detail
