#pragma once

#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace stagewise {

namespace detail {

inline constexpr const char* placement_forms =
    "\"auto\" (one stage per GPU, or all on cuda:0 with fewer GPUs than stages, or all on the "
    "CPU without a GPU), \"cpu\", \"cuda\" (as auto, but a GPU is required), \"cuda:N\" (all on "
    "GPU N), or one device per stage separated by commas (\"cpu,cuda:0\")";

// "cpu" or "cuda:N" with GPU N present; `spec` is the whole argument, named in the messages.
inline torch::Device parse_one_device(std::string_view name, const std::string& spec,
                                      std::size_t gpus) {
  if (name == "cpu") return torch::Device(torch::kCPU);
  constexpr std::string_view prefix = "cuda:";
  bool numbered = name.size() > prefix.size() && name.size() <= prefix.size() + 3 &&
                  name.substr(0, prefix.size()) == prefix;
  std::size_t index = 0;
  for (std::size_t i = prefix.size(); numbered && i < name.size(); ++i) {
    numbered = name[i] >= '0' && name[i] <= '9';
    index = index * 10 + static_cast<std::size_t>(name[i] - '0');
  }
  const std::string where = name == spec ? "" : " in \"" + spec + "\"";
  TORCH_CHECK(numbered, "stagewise::place_stages: unknown device \"", name, "\"", where, "; use ",
              placement_forms);
  if (index >= gpus) {
    const std::string fix =
        gpus == 0 ? "; use \"cpu\", or \"auto\" to take a GPU only when there is one"
        : gpus == 1
            ? " (cuda:0); use cuda:0, or \"auto\""
            : " (cuda:0 .. cuda:" + std::to_string(gpus - 1) + "); use one of those, or \"auto\"";
    TORCH_CHECK(false, "stagewise::place_stages: \"", name, "\"", where,
                " asks for a GPU that is not there: this machine has ", gpus, " CUDA GPU",
                gpus == 1 ? "" : "s", fix);
  }
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace detail

/// Devices for the `stages` stages of a pipe, from a flag such as `--device`: "auto" (the
/// default) puts one stage per GPU when there are at least as many CUDA GPUs as stages, else every
/// stage on cuda:0 when there is a GPU, else every stage on the CPU; "cpu" puts all on the CPU;
/// "cuda" is "auto" that refuses to run without a GPU; "cuda:N" puts all on GPU N; a comma list
/// ("cpu,cuda:0") gives exactly one device per stage. Anything else, a GPU that is not there or a
/// list of the wrong length is an error naming the fix.
///   auto pipe = stagewise::Pipe(model, stagewise::balance{3, 2},
///                               stagewise::PipeOptions().devices(stagewise::place_stages(2)));
inline std::vector<torch::Device> place_stages(std::size_t stages,
                                               const std::string& device = "auto") {
  const std::size_t gpus = torch::cuda::device_count();
  if (device == "auto" || device == "cuda") {
    TORCH_CHECK(
        device == "auto" || gpus > 0,
        "stagewise::place_stages: \"cuda\" asks for a GPU, but this machine has no CUDA GPU "
        "(torch::cuda::device_count() is 0); use \"auto\" to fall back to the CPU, or "
        "\"cpu\"");
    std::vector<torch::Device> out;
    for (std::size_t k = 0; k < stages; ++k) {
      if (gpus == 0) {
        out.emplace_back(torch::kCPU);
      } else {
        out.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(gpus >= stages ? k : 0));
      }
    }
    return out;
  }
  if (device.find(',') == std::string::npos) {
    return std::vector<torch::Device>(stages, detail::parse_one_device(device, device, gpus));
  }
  std::vector<torch::Device> out;
  for (std::size_t begin = 0;;) {
    const std::size_t end = std::min(device.find(',', begin), device.size());
    out.push_back(detail::parse_one_device(std::string_view(device).substr(begin, end - begin),
                                           device, gpus));
    if (end == device.size()) break;
    begin = end + 1;
  }
  TORCH_CHECK(out.size() == stages, "stagewise::place_stages: \"", device, "\" names ", out.size(),
              " devices for ", stages, " stage", stages == 1 ? "" : "s",
              "; give exactly one device per stage, or one device (\"cpu\", \"cuda:0\") for all");
  return out;
}

}  // namespace stagewise
