#pragma once

#include <torch/types.h>

#include <map>
#include <mutex>
#include <tuple>

namespace stagewise {

/// A cached, size-0 tensor used only to carry an autograd dependency, never data.
///
/// One tensor exists per (device, requires_grad); every call with the same key returns the same
/// tensor, so phonies cost no allocation on the hot path. Autograd functions that return a phony
/// must return `phony(...).detach()` so that the cached tensor never acquires a grad_fn.
///   auto p = stagewise::phony(torch::kCPU, /*requires_grad=*/true);  // p.numel() == 0
inline torch::Tensor phony(const torch::Device& device = torch::kCPU, bool requires_grad = true) {
  using key_type = std::tuple<int, int, bool>;
  // Leaked on purpose: a static map would be destroyed at exit after the device runtimes it
  // refers to, and freeing a CUDA tensor then crashes.
  static auto* cache = new std::map<key_type, torch::Tensor>();
  static auto* mutex = new std::mutex();
  const key_type key{static_cast<int>(device.type()), device.index(), requires_grad};
  std::lock_guard<std::mutex> lock(*mutex);
  auto it = cache->find(key);
  if (it == cache->end()) {
    auto tensor = torch::empty({0}, torch::TensorOptions().device(device));
    tensor.set_requires_grad(requires_grad);
    it = cache->emplace(key, std::move(tensor)).first;
  }
  return it->second;
}

}  // namespace stagewise
