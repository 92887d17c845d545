#pragma once

#include "stagewise/core/detail/stage_spec.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace stagewise::detail {

// The one device a module's parameters and buffers live on; nothing for a module without any.
// A module spread over several devices is an error naming the fix (`who`: the pipe, `k`: its
// stage), since the pipe runs each stage on one device.
inline std::optional<torch::Device> module_device(const torch::nn::Module& module,
                                                  const std::string& who, std::size_t k) {
  std::optional<torch::Device> found;
  auto see = [&](const torch::Tensor& t) {
    if (!t.defined()) return;
    if (!found) {
      found = t.device();
      return;
    }
    TORCH_CHECK(*found == t.device(), who, ": stage ", k, " has tensors on ", found->str(),
                " and on ", t.device().str(),
                "; a stage runs on one device. Give PipeOptions().devices({...}) with one device "
                "per stage (the pipe moves each stage there), or move the model to one device "
                "first");
  };
  for (const auto& p : module.parameters()) see(p);
  for (const auto& b : module.buffers()) see(b);
  return found;
}

// A stage's device as given, checked: the CPU, or a CUDA device this machine has (`cuda` without
// an index means the current one, as for tensors).
inline torch::Device checked_device(torch::Device d, const std::string& who, std::size_t k) {
  TORCH_CHECK(d.type() == torch::kCPU || d.type() == torch::kCUDA, who, ": stage ", k,
              " is given device ", d.str(),
              "; stages run on the CPU or on CUDA GPUs (torch::kCPU, "
              "torch::Device(torch::kCUDA, i))");
  if (d.type() == torch::kCPU) return torch::Device(torch::kCPU);
  const auto count = static_cast<int>(torch::cuda::device_count());
  TORCH_CHECK(count > 0, who, ": stage ", k, " is given ", d.str(),
              " but no CUDA GPU is available (a CPU-only LibTorch, or no device visible); "
              "place it on torch::kCPU, or see stagewise::place_stages for a placement that "
              "uses the GPUs present");
  if (!d.has_index()) d = c10::impl::VirtualGuardImpl(torch::kCUDA).getDevice();
  TORCH_CHECK(d.index() < count, who, ": stage ", k, " is given ", d.str(),
              " but this machine has ", count, " CUDA device", count == 1 ? "" : "s",
              " (cuda:0 to cuda:", count - 1, "); give devices that exist");
  return d;
}

// Each stage's device, with its module moved there. With `devices` given there must be exactly
// one per stage, and every stage's module is moved to its device (also to the CPU: a model
// already on a GPU follows the list). Without, each stage stays where its module already is (the
// CPU for a stage without parameters or buffers, a stage whose module is on several devices
// is an error). `local(k)` says whether stage k's module lives in this process (others are
// neither inspected nor moved).
template <class Local>
std::vector<torch::Device> place_stage_modules(std::vector<StageSpec>& specs,
                                               const std::vector<torch::Device>& devices,
                                               const std::string& who, Local local) {
  const std::size_t n = specs.size();
  TORCH_CHECK(devices.empty() || devices.size() >= n, who, ": ", n, " stages but only ",
              devices.size(),
              " devices; give one device per stage (devices may repeat, e.g. torch::kCPU for "
              "all), or fewer stages");
  TORCH_CHECK(devices.empty() || devices.size() == n, who, ": ", n, " stages but ", devices.size(),
              " devices; give exactly one device per stage (devices may repeat), or leave "
              "devices out to keep each stage where its module is");
  std::vector<torch::Device> out;
  out.reserve(n);
  for (std::size_t k = 0; k < n; ++k) {
    const auto& module = specs[k].module;
    if (!devices.empty()) {
      const torch::Device d = checked_device(devices[k], who, k);
      if (module && local(k)) module->to(d);
      out.push_back(d);
      continue;
    }
    std::optional<torch::Device> d;
    if (module && local(k)) d = module_device(*module, who, k);
    out.push_back(d.value_or(torch::Device(torch::kCPU)));
  }
  return out;
}

}  // namespace stagewise::detail
