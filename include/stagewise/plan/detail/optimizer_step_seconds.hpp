#pragma once

// The optimizer step's time that plan_pipeline charges each stage: each layer's step profiled
// once on copies of its parameters, on the device and on the host (for state off the device).

#include "stagewise/plan/plan_options.hpp"

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <chrono>
#include <memory>
#include <vector>

namespace stagewise::detail {

// One optimizer step's time on copies of `params` (each with a gradient), the second of two (the
// first makes the state).
inline double optimizer_step_seconds(const PlanOptions& o, const std::vector<torch::Tensor>& params) {
  if (params.empty()) return 0.0;
  std::vector<torch::Tensor> copies;
  for (const auto& p : params) {
    auto c = p.detach().clone().requires_grad_(true);
    c.mutable_grad() = torch::randn_like(c);
    copies.push_back(c);
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (o.adam()) {
    opt = std::make_unique<torch::optim::Adam>(
        copies, torch::optim::AdamOptions(o.adam()->lr).weight_decay(o.adam()->weight_decay));
  } else {
    opt = std::make_unique<torch::optim::SGD>(
        copies, torch::optim::SGDOptions(o.sgd()->lr).momentum(o.sgd()->momentum));
  }
  torch::NoGradGuard no_grad;
  opt->step();
  const auto t0 = std::chrono::steady_clock::now();
  opt->step();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Each layer's optimizer step time (summed per stage later).
inline std::vector<double> layer_step_seconds(const torch::nn::Sequential& model,
                                              const PlanOptions& o) {
  std::vector<double> out;
  for (const auto& layer : model->children()) out.push_back(optimizer_step_seconds(o, layer->parameters()));
  return out;
}

// Each layer's optimizer step on the host (CPU copies of its parameters): the layers' device
// steps when the model is on the CPU already.
inline std::vector<double> layer_host_step_seconds(const torch::nn::Sequential& model,
                                                   const PlanOptions& o,
                                                   const std::vector<double>& device_steps) {
  std::vector<double> out;
  for (const auto& layer : model->children()) {
    std::vector<torch::Tensor> host;
    bool moved = false;
    for (const auto& p : layer->parameters()) {
      moved = moved || !p.device().is_cpu();
      host.push_back(p.detach().to(torch::kCPU));
    }
    out.push_back(moved ? optimizer_step_seconds(o, host) : device_steps[out.size()]);
  }
  return out;
}

}  // namespace stagewise::detail
