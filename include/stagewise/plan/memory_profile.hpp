#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/plan/memory_plan.hpp"
#include "stagewise/stage/partition.hpp"
#include "stagewise/stage/profile.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace stagewise {

/// What one micro-batch (`sample`) costs each stage of `model` split by `b`, for
/// `schedule::plan_memory`: its activations (`profile_sizes`, parameters left out) and what it
/// keeps when checkpointed (the bytes of its input; skips it pops are not counted). Measured on
/// copies of the layers, as `profile_sizes` is; the model is left as it was.
///   auto memory = stagewise::profile_stage_memory(model, sw::balance{2, 2}, torch::randn({64,
///   256}));
inline std::vector<schedule::StageMemory> profile_stage_memory(const torch::nn::Sequential& model,
                                                               const balance& b,
                                                               const Batch& sample,
                                                               BalanceOptions options = {}) {
  const char* who = "stagewise::profile_stage_memory";
  std::int64_t layers = 0;
  for (auto k : b) layers += k;
  TORCH_CHECK(layers == static_cast<std::int64_t>(model->size()), who, ": the balance covers ",
              layers, " layers but the model has ", model->size(),
              "; give a balance that adds up to the number of layers");
  const auto sizes = profile_sizes(model, sample, options.param_scale(0));
  // Each layer's input bytes, on a pass over copies of the layers.
  std::vector<double> inputs;
  {
    const torch::Device device = detail::profiling_device(model, sample, options, who);
    detail::Sandbox sandbox(model, device, who);
    detail::profile_pass(sandbox.seq(), sample, device, [&](std::size_t i, const Batch& in) {
      double bytes = 0;
      for (const auto& t : in) bytes += t.defined() ? static_cast<double>(t.nbytes()) : 0.0;
      inputs.push_back(bytes);
      return detail::run_profiled_layer(sandbox.seq(), i, in, who);
    });
  }
  std::vector<schedule::StageMemory> out;
  std::size_t first = 0;
  for (auto k : b) {
    schedule::StageMemory m;
    m.kept = inputs[first];
    for (std::size_t l = first; l < first + static_cast<std::size_t>(k); ++l)
      m.activations += sizes[l];
    out.push_back(m);
    first += static_cast<std::size_t>(k);
  }
  return out;
}

}  // namespace stagewise
