#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/runtime/stream.hpp"
#include "stagewise/skip/namespace.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/skip/tracker.hpp"
#include "stagewise/stage/detail/counting_allocator.hpp"
#include "stagewise/stage/partition.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#if defined(STAGEWISE_WITH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise {

/// Options of `balance_by_time` / `balance_by_size` and of `profile_times` / `profile_sizes`,
/// as chained setters.
///   stagewise::BalanceOptions().rounds(5).device(torch::kCUDA)
class BalanceOptions {
 public:
  /// Where the profiling copies run (default: the device of the model's first parameter, or the
  /// CPU). Profile where the stages will run: costs differ between devices.
  BalanceOptions& device(torch::Device d) {
    device_ = d;
    return *this;
  }
  /// Timed rounds over every layer, after one untimed warm-up round (default 3). A layer's time is
  /// its fastest round: the one least disturbed by other work on the machine.
  BalanceOptions& rounds(int n) {
    TORCH_CHECK(n >= 1, "stagewise::BalanceOptions: rounds must be at least 1, got ", n);
    rounds_ = n;
    return *this;
  }
  /// balance_by_size: bytes counted per byte of parameters (default 2: the parameter and its
  /// gradient; use 3 for SGD with momentum, 4 for Adam, whose states also live with the stage).
  BalanceOptions& param_scale(double s) {
    TORCH_CHECK(s >= 0, "stagewise::BalanceOptions: param_scale must be non-negative, got ", s);
    param_scale_ = s;
    return *this;
  }

  const std::optional<torch::Device>& device() const { return device_; }
  int rounds() const { return rounds_; }
  double param_scale() const { return param_scale_; }

 private:
  std::optional<torch::Device> device_;
  int rounds_ = 3;
  double param_scale_ = 2.0;
};

namespace detail {

inline void check_sample(const Batch& sample, const char* who) {
  TORCH_CHECK(sample.size() > 0, who,
              ": the sample is an empty batch; give a batch the model accepts, e.g. "
              "torch::randn({rows, features})");
  for (std::size_t i = 0; i < sample.size(); ++i) {
    const auto& t = sample[i];
    TORCH_CHECK(t.defined(), who, ": tensor ", i,
                " of the sample is undefined; give a batch the model accepts, e.g. "
                "torch::randn({rows, features})");
    TORCH_CHECK(t.dim() >= 1 && t.size(0) >= 1, who, ": tensor ", i, " of the sample has shape ",
                t.sizes(),
                "; give a batch with at least one row (dimension 0 is the batch), like the "
                "micro-batches the pipe will run");
  }
}

inline void refuse_gradients(const torch::nn::Module& model, const char* who) {
  for (const auto& p : model.named_parameters()) {
    TORCH_CHECK(!p.value().grad().defined(), who, ": parameter '", p.key(),
                "' already has a gradient. Profile before training, or drop the gradients "
                "first (model->zero_grad(/*set_to_none=*/true)); profiling never touches "
                "the model's gradients");
  }
}

// The device the model's parameters (or buffers) are on; the CPU for a stateless model.
inline torch::Device model_device(const torch::nn::Module& model) {
  for (const auto& p : model.parameters()) return p.device();
  for (const auto& b : model.buffers()) {
    if (b.defined()) return b.device();
  }
  return torch::kCPU;
}

// What profiling runs on: deep copies of the layers, in training mode, on the profiling device.
// A layer that cannot be copied (not a torch::nn::Cloneable) is profiled in place instead, on its
// own device, and everything it changes (buffers, modes, gradients) is put back afterwards.
class Sandbox {
 public:
  Sandbox(const torch::nn::Sequential& model, torch::Device device, const char* who) {
    try {
      seq_ = torch::nn::Sequential(
          std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone(device)));
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      if (what.find("clone() has not been implemented") == std::string::npos) throw;
      const torch::Device home = model_device(*model);
      TORCH_CHECK(home == device, who, ": the model cannot be copied to ", device.str(),
                  " for profiling (", what, "). Profile it where it is (BalanceOptions().device(",
                  home.str(), ")), or make its layers torch::nn::Cloneable");
      seq_ = model;
      for (const auto& m : model->modules()) modes_.emplace_back(m, m->is_training());
      torch::NoGradGuard no_grad;
      for (const auto& b : model->buffers()) {
        if (b.defined()) buffers_.emplace_back(b, b.clone());
      }
      parameters_ = model->parameters();
    }
    seq_->train();
  }
  ~Sandbox() {
    torch::NoGradGuard no_grad;
    for (auto& [buffer, copy] : buffers_) buffer.copy_(copy);
    for (auto& p : parameters_) p.mutable_grad() = torch::Tensor();
    // modules() lists parents before children, and train() recurses: restore in that order.
    for (auto& [m, training] : modes_) m->train(training);
  }
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;

  torch::nn::Sequential& seq() { return seq_; }

 private:
  torch::nn::Sequential seq_;
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> modes_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers_;
  std::vector<torch::Tensor> parameters_;
};

// A fresh input for one layer: copies cut from the previous layer's graph, so in-place layers may
// write them; leaves that require grad when floating point and `grad` (every layer but the
// first, whose input needs no gradient in training unless the sample asks for one).
inline torch::Tensor fresh_leaf(const torch::Tensor& t, bool grad) {
  if (!t.defined()) return t;
  auto leaf = t.detach();
  if (!grad || !leaf.is_floating_point()) return leaf.clone();
  leaf.requires_grad_(true);
  return leaf.clone();
}

inline Batch fresh_input(const Batch& b, bool grad) {
  if (b.atomic()) return Batch(fresh_leaf(b.tensor(), grad));
  std::vector<torch::Tensor> out;
  for (const auto& t : b.tensors()) out.push_back(fresh_leaf(t, grad));
  return Batch(std::move(out));
}

inline bool requires_grad(const Batch& b) {
  for (std::size_t i = 0; i < b.size(); ++i) {
    if (b[i].requires_grad()) return true;
  }
  return false;
}

// Skips stashed and popped while profiling layer by layer: each pop receives a fresh leaf, so a
// layer's backward stops at its own inputs.
class ProfilingSkips final : public SkipTrackerBase {
 public:
  void stash(const SkipInfo& skip, torch::Tensor tensor) override {
    tensors_[&skip] = tensor.defined() ? tensor.detach() : tensor;
  }
  torch::Tensor pop(const SkipInfo& skip) override {
    auto it = tensors_.find(&skip);
    TORCH_CHECK(it != tensors_.end(), "stagewise: while profiling, a layer pops skip ",
                skip.describe(),
                " that no earlier layer stashed; the layer that stashes it must come first");
    auto out = fresh_leaf(it->second, /*grad=*/true);
    tensors_.erase(it);
    return out;
  }

 private:
  std::map<const SkipInfo*, torch::Tensor> tensors_;
};

inline Batch run_profiled_layer(torch::nn::Sequential& seq, std::size_t i, const Batch& in,
                                const char* who) {
  auto& layer = *(seq->begin() + static_cast<std::ptrdiff_t>(i));
  const std::string where = "layer " + std::to_string(i) + " (" + layer.ptr()->name() + ")";
  try {
    torch::nn::AnyValue v =
        in_layer_frame(*layer.ptr(), [&] { return call_first(layer, in, i == 0); });
    return any_to_batch(std::move(v), where);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(
        Error, c10::str(who, ": ", where, " failed on the sample: ", e.what_without_backtrace(),
                        " Give a sample the model accepts (model->forward(sample) "
                        "must work)."));
  } catch (const std::exception& e) {
    C10_THROW_ERROR(Error, c10::str(who, ": ", where, " failed on the sample: ", e.what(),
                                    " Give a sample the model accepts (model->forward(sample) "
                                    "must work)."));
  }
}

inline void backward_of(const Batch& out) {
  std::vector<torch::Tensor> roots, grads;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i].defined() && out[i].requires_grad()) {
      roots.push_back(out[i]);
      grads.push_back(torch::ones_like(out[i]));
    }
  }
  if (!roots.empty()) torch::autograd::backward(roots, grads);
}

inline Batch sample_on(const Batch& sample, torch::Device device) {
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0; i < sample.size(); ++i)
    out.push_back(runtime::copy_to(sample[i].detach(), device));
  return sample.atomic() ? Batch(out[0]) : Batch(std::move(out));
}

inline void synchronize(torch::Device device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.getStream(device).synchronize();
}

// Bytes of tensor memory allocated now on `device`.
inline int64_t allocated_bytes(torch::Device device, const char* who) {
#if defined(STAGEWISE_WITH_CUDA)
  if (device.is_cuda()) {
    const auto index = device.has_index() ? device.index() : c10::DeviceIndex{0};
    // The allocator's statistics exist once CUDA is initialized, which LibTorch does lazily, on
    // the first CUDA tensor; before that getDeviceStats fails ("did you call init?"). An empty
    // tensor initializes CUDA and allocates nothing.
    (void)torch::empty({0}, torch::TensorOptions().device(device));
    // Entry 0 is StatType::AGGREGATE (all pools), whose header moved in LibTorch 2.x.
    return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current;
  }
#endif
  TORCH_CHECK(
      device.is_cpu(), who, ": measuring memory on ", device.str(),
      " needs the CUDA caching allocator's statistics: build with -DSTAGEWISE_WITH_CUDA "
      "against a CUDA LibTorch, or profile on the CPU (BalanceOptions().device(torch::kCPU))");
  return CountingCpuAllocator::instance().current();
}

// What profile_times and profile_sizes check first; returns the device they measure on.
inline torch::Device profiling_device(const torch::nn::Sequential& model, const Batch& sample,
                                      const BalanceOptions& options, const char* who) {
  check_sample(sample, who);
  refuse_gradients(*model, who);
  return options.device().value_or(model_device(*model));
}

// One pass over the sandbox's layers in order: `layer(i, in)` runs layer i on the previous
// layer's output (a fresh leaf) with the skips it pops, and returns its output.
template <class Layer>
void profile_pass(torch::nn::Sequential& seq, const Batch& sample, torch::Device device,
                  Layer&& layer) {
  ProfilingSkips skips;
  UseSkipTracker use(skips);
  Batch batch = sample_on(sample, device);
  for (std::size_t i = 0; i < seq->size(); ++i) {
    Batch in = fresh_input(batch, i > 0 || requires_grad(sample));
    batch = layer(i, in);
  }
}

}  // namespace detail

/// Each layer's forward + backward time in seconds, measured on copies of `model`'s layers fed
/// `sample` (one micro-batch, like those the pipe will run): layer by layer in order, each given
/// the previous layer's output and the skips it pops. The model itself (parameters, buffers,
/// gradients, mode, device) is left as it was; a parameter that already has a gradient is an
/// error.
///   auto times = stagewise::profile_times(model, torch::randn({32, 256}));
inline std::vector<double> profile_times(const torch::nn::Sequential& model, const Batch& sample,
                                         const BalanceOptions& options = {}) {
  const char* who = "stagewise::profile_times";
  const torch::Device device = detail::profiling_device(model, sample, options, who);
  detail::Sandbox sandbox(model, device, who);
  auto& seq = sandbox.seq();
  std::vector<double> best(seq->size(), std::numeric_limits<double>::infinity());
  for (int round = 0; round <= options.rounds(); ++round) {  // round 0 warms up
    detail::profile_pass(seq, sample, device, [&](std::size_t i, const Batch& in) {
      detail::synchronize(device);
      const auto start = std::chrono::steady_clock::now();
      Batch out = detail::run_profiled_layer(seq, i, in, who);
      detail::backward_of(out);
      detail::synchronize(device);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      if (round > 0) best[i] = std::min(best[i], took.count());
      return out;
    });
  }
  return best;
}

/// Each layer's memory in bytes: what its forward keeps alive for backward on `sample` (its
/// output and saved activations; on the CPU counted by a counting allocator, on CUDA read from
/// the caching allocator's statistics when built with -DSTAGEWISE_WITH_CUDA) plus
/// `param_scale` times its parameters' bytes. Measured like `profile_times`, on copies.
///   auto sizes = stagewise::profile_sizes(model, torch::randn({32, 256}));
inline std::vector<double> profile_sizes(const torch::nn::Sequential& model, const Batch& sample,
                                         const BalanceOptions& options = {}) {
  const char* who = "stagewise::profile_sizes";
  const torch::Device device = detail::profiling_device(model, sample, options, who);
  if (!device.is_cpu()) (void)detail::allocated_bytes(device, who);  // fails early without CUDA
  detail::Sandbox sandbox(model, device, who);
  auto& seq = sandbox.seq();
  std::vector<double> sizes;
  std::optional<detail::CountCpuBytes> counting;
  if (device.is_cpu()) counting.emplace();
  detail::profile_pass(seq, sample, device, [&](std::size_t i, const Batch& in) {
    detail::synchronize(device);
    const int64_t before = detail::allocated_bytes(device, who);
    Batch out = detail::run_profiled_layer(seq, i, in, who);
    detail::synchronize(device);
    const int64_t after = detail::allocated_bytes(device, who);
    double params = 0;
    for (const auto& p : (seq->begin() + static_cast<std::ptrdiff_t>(i))->ptr()->parameters()) {
      params += static_cast<double>(p.numel() * static_cast<int64_t>(p.element_size()));
    }
    sizes.push_back(static_cast<double>(std::max<int64_t>(after - before, 0)) +
                    options.param_scale() * params);
    return out;
  });
  return sizes;
}

}  // namespace stagewise
