#pragma once

// Internals of optim::FusedStep: one slot per parameter and the hook that steps it.

#include "stagewise/optim/detail/amp_kernels.hpp"
#include "stagewise/optim/optimizer_for.hpp"
#include "stagewise/optim/state_offload.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagewise::detail {

/// The parameters given to `optim::FusedStep`: a plain list, or `named_parameters()` so that
/// error messages can name them.
struct ParameterList {
  ParameterList(std::vector<torch::Tensor> params) : tensors(std::move(params)) {}
  ParameterList(std::initializer_list<torch::Tensor> params) : tensors(params) {}
  ParameterList(const torch::OrderedDict<std::string, torch::Tensor>& named)
      : tensors(named.values()), names(named.keys()) {}
  std::vector<torch::Tensor> tensors;
  std::vector<std::string> names;  // empty, or one per tensor
};

// The key a torch::optim optimizer files a parameter's state under: the TensorImpl address as a
// string in LibTorch 1.x, the address itself in 2.x. (A template so that the branch for the other
// version is discarded.)
template <class Optimizer = torch::optim::Optimizer>
auto optimizer_state_key(const torch::Tensor& param) {
  using map_type = std::remove_cvref_t<decltype(std::declval<Optimizer&>().state())>;
  using key_type = typename map_type::key_type;
  if constexpr (std::is_same_v<key_type, std::string>) {
    std::ostringstream os;  // what c10::guts::to_string does in 1.x's optimizers
    os << param.unsafeGetTensorImpl();
    return os.str();
  } else {
    return static_cast<key_type>(param.unsafeGetTensorImpl());
  }
}

// One parameter's contribution to clip_grad_norm_'s total norm, computed as it does.
inline torch::Tensor grad_norm_part(const torch::Tensor& grad, double norm_type) {
  if (norm_type == std::numeric_limits<double>::infinity()) return grad.abs().max();
  if (norm_type == 0) return torch::ones({}, grad.options());  // norm 0 counts them: any value
  return grad.norm(norm_type);
}

enum class FusedMode : int { update, norm };

// What a GradScaler gives the two passes of a scaled fused step (amp::GradScaler::step(fused,
// closure), clip_grad_norm_step with a scaler): each gradient is unscaled before it is used, and
// in the first pass checked for inf/NaN. `scale` is the scaler's scale tensor, read at the first
// gradient (a closure that scales its own loss creates it); the inverse is taken as PyTorch's
// unscale_ does (in double, then float) and copied once to each device that asks.
struct ScaledPass {
  const void* owner = nullptr;              // the GradScaler
  const torch::Tensor* scale = nullptr;     // its scale tensor
  std::int64_t scaled_before = 0;           // its count of scaled losses when the pass began
  std::mutex mutex;                         // inv, from the stages' threads
  std::vector<torch::Tensor> inv;           // 1 / scale, one per device

  torch::Tensor inv_scale(const c10::Device& device) {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& t : inv) {
      if (t.device() == device) return t;
    }
    TORCH_CHECK(scale != nullptr && scale->defined(),
                "stagewise::amp::GradScaler: a gradient arrived before any loss was scaled. "
                "Scale the loss the closure back-propagates (scaler.scale(loss).backward(), or "
                "return the loss and let the step scale it)");
    if (inv.empty()) inv.push_back(scale->to(torch::kDouble).reciprocal().to(torch::kFloat));
    if (inv.front().device() == device) return inv.front();
    inv.push_back(inv.front().to(device, /*non_blocking=*/false, /*copy=*/true));
    return inv.back();
  }
};

// Shared by every parameter's hook. Written only between backward passes.
struct FusedShared {
  std::atomic<FusedMode> mode{FusedMode::update};
  bool strict = false;      // finish_step: also report parameters without every gradient
  double norm_type = 2.0;   // norm pass: the norm to take
  torch::Tensor clip_coef;  // update pass: defined while clipping, multiplies each gradient
  bool norms_gathered = false;  // norm pass: every process's norms are totalled (a pipe's clip)
  bool measure_norm = true;     // norm pass: take each gradient's norm (false: a scaler's check)
  bool in_passes = false;       // a two-pass step is running (clip_grad_norm_step, scaler.step)
  ScaledPass* scaled = nullptr;  // while a scaled two-pass step runs: unscale every gradient
  std::atomic<std::int64_t> updated{0};  // parameters stepped since the last finish_step
  // Where the offloaded parameters' state lives and their step runs (FusedStep::offload_state;
  // owned by FusedState), and whether step_parameter leaves their updates to the step's end (a
  // data-parallel pipe's reductions: the pipe finishes them) instead of finishing each at once.
  optim::StateOffload* offload = nullptr;
  bool defer_offload_finish = false;
};

// One parameter: its optimizer, its hook's node and its per-step counts. Touched by the thread
// running this parameter's backward (one stage's worker) and, between steps, by the caller.
struct FusedSlot {
  torch::Tensor param;
  std::string name;
  std::size_t index = 0;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::shared_ptr<torch::autograd::Node> accumulator;
  std::uintptr_t hook_key = 0;
  int accumulation_steps = 1;
  std::atomic<int> arrivals{0};  // gradients since the last step
  std::atomic<int> updates{0};   // steps since the last finish_step
  torch::Tensor norm;            // norm pass result
  bool has_norm = false;
  torch::Tensor found_inf;       // a scaled norm pass: 1 if the gradient held an inf or a NaN
  bool offloaded = false;        // its state and step are the shared offload's
  FusedShared* shared = nullptr;

  std::string describe() const {
    std::ostringstream os;
    if (!name.empty()) {
      os << "parameter '" << name << "'";
    } else {
      os << "parameter " << index;
    }
    if (param.defined()) os << " (shape " << param.sizes() << ")";
    return os.str();
  }

  // GradScaler refuses fp16 gradients, as PyTorch's unscale_ does: fp16 parameters cannot take
  // small updates; autocast keeps them fp32 and runs the fp16 arithmetic.
  void check_grad_dtype(const torch::Tensor& grad) const {
    TORCH_CHECK(grad.scalar_type() != torch::kHalf, "stagewise::amp::GradScaler: ", describe(),
                " has an fp16 gradient: attempting to unscale FP16 gradients. Keep the "
                "parameters in fp32 and run the forward under fp16 autocast instead of "
                "converting the model to fp16");
  }

  // Hands the final gradient to the offload, whose step updates the parameter only when the step
  // ends (finish_step): a second update in one step would start from the unchanged parameter.
  void hand_over(const torch::Tensor& grad) {
    TORCH_CHECK(updates.load(std::memory_order_relaxed) == 0,
                "stagewise::optim::FusedStep: ", describe(),
                " got its last gradient of a step again before the step ended; its state is "
                "offloaded (", shared->offload->describe(),
                "), which updates it only when the step ends: call fused.finish_step() after "
                "each step's backward passes (a pipe's train_step does), and set "
                "set_accumulation_steps(k) to the number of backward passes per step");
    shared->offload->step(index, grad, optimizer->param_groups()[0].options());
  }

  // Runs after AccumulateGrad has added this backward's gradient to param.grad().
  void on_gradient() {
    const int arrived = arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (arrived < accumulation_steps) return;  // not the last micro-batch: keep accumulating
    arrivals.store(0, std::memory_order_relaxed);
    use_gradient();
  }

  // Uses gradients still pending at the end of a step: the parameter got fewer than k (some
  // micro-batches did not reach it, e.g. an expert without tokens there), and steps on their sum,
  // as an unfused optimizer would. Between steps only (no backward running).
  void flush() {
    if (arrivals.load() == 0) return;
    arrivals.store(0);
    use_gradient();
  }

  // Steps on (or, in the norm pass, measures) the gradient in .grad, then frees it. Under a
  // scaler the gradient is unscaled first, as GradScaler::unscale_ does, and in the norm pass
  // checked for inf/NaN.
  void use_gradient() {
    torch::NoGradGuard no_grad;
    torch::Tensor& grad = param.mutable_grad();
    ScaledPass* scaled = shared->scaled;
    if (shared->mode.load(std::memory_order_acquire) == FusedMode::norm) {
      if (grad.defined()) {
        if (scaled != nullptr) {
          check_grad_dtype(grad);
          if (!found_inf.defined()) found_inf = torch::zeros({}, grad.options().dtype(torch::kFloat));
          unscale_and_check(grad, found_inf, scaled->inv_scale(grad.device()));
        }
        if (shared->measure_norm) {
          norm = grad_norm_part(grad, shared->norm_type);
          has_norm = true;
        }
      }
    } else {
      // Like an unfused optimizer, a parameter whose gradient is undefined is not stepped.
      if (grad.defined()) {
        if (scaled != nullptr) {
          auto ignored = torch::zeros({}, grad.options().dtype(torch::kFloat));  // checked before
          unscale_and_check(grad, ignored, scaled->inv_scale(grad.device()), shared->clip_coef);
        } else if (shared->clip_coef.defined()) {
          grad.mul_(shared->clip_coef);
        }
        if (offloaded) {
          hand_over(grad);
        } else {
          optimizer->step();
        }
      }
      updates.fetch_add(1, std::memory_order_relaxed);
      shared->updated.fetch_add(1, std::memory_order_relaxed);
    }
    grad.reset();  // the point of it all: the gradient is gone as soon as it is used
  }
};

// The post hook on a parameter's AccumulateGrad node. AccumulateGrad has no outputs, so
// returning them costs no allocation.
struct FusedPostHook final : torch::autograd::FunctionPostHook {
  explicit FusedPostHook(FusedSlot* s) : slot(s) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    slot->on_gradient();
    return outputs;
  }
  FusedSlot* slot;
};

// Everything a FusedStep owns, on the heap so that hooks keep valid pointers when it moves.
struct FusedState {
  std::vector<std::unique_ptr<FusedSlot>> slots;
  std::unordered_map<const void*, FusedSlot*> by_impl;  // each slot by its parameter's impl
  FusedShared shared;
  optim::OptimizerFactory factory;
  bool attached = false;
  // Detached, but stepped by a caller through step_parameter as each averaged gradient arrives
  // (distributed::DataParallel::step_with): two-pass steps (clip, GradScaler) run through it.
  bool driven = false;
  // Sharded over data-parallel replicas (distributed::DataParallel::step_with, the 2-D pipe):
  // the slots whose optimizer state this process keeps (empty: all), and, for DataParallel, where
  // a clip's norms and a GradScaler's inf/NaN checks are totalled when the caller names nothing
  // (every replica's, not this one's alone). Set through FusedStepAccess.
  std::vector<char> owned;
  std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)> shard_norms;
  std::function<torch::Tensor(const torch::Tensor&)> shard_found_inf;
  bool owns(std::size_t i) const { return owned.empty() || owned[i] != 0; }
  std::shared_ptr<optim::StateOffload> offload;  // FusedStep::offload_state; shared.offload
};

// Binds `offload` to the fused step's parameters (FusedStep::offload_state) and moves the state
// they have into it; the device's copy is dropped only once all of it is there.
inline void install_offload(FusedState& st, std::shared_ptr<optim::StateOffload> offload) {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (const auto& slot : st.slots) {
    params.push_back(slot->param);
    names.push_back(slot->name);
  }
  offload->bind(params, names, st.factory);
  for (auto& slot : st.slots) {
    if (!offload->holds(slot->index)) continue;
    auto& map = slot->optimizer->state();
    auto it = map.find(optimizer_state_key(slot->param));
    if (it != map.end()) offload->set_state(slot->index, it->second->clone());
  }
  for (auto& slot : st.slots) {
    slot->offloaded = offload->holds(slot->index);
    if (slot->offloaded) slot->optimizer->state().clear();
  }
  st.offload = std::move(offload);
  st.shared.offload = st.offload.get();
}

// Checks the parameters and builds one optimizer per parameter (FusedStep's constructor).
inline std::unique_ptr<FusedState> make_fused_state(ParameterList params,
                                                    optim::OptimizerFactory factory) {
  TORCH_CHECK(static_cast<bool>(factory),
              "stagewise::optim::FusedStep: the optimizer factory is empty. Pass options "
              "(e.g. torch::optim::AdamOptions(1e-3)) or a factory that builds an optimizer.");
  TORCH_CHECK(!params.tensors.empty(),
              "stagewise::optim::FusedStep: no parameters to optimize. Pass "
              "model->parameters() or model->named_parameters().");
  auto state = std::make_unique<FusedState>();
  state->factory = std::move(factory);
  for (std::size_t i = 0; i < params.tensors.size(); ++i) {
    auto slot = std::make_unique<FusedSlot>();
    slot->param = params.tensors[i];
    slot->name = params.names.empty() ? std::string() : params.names[i];
    slot->index = i;
    slot->shared = &state->shared;
    const auto& p = slot->param;
    TORCH_CHECK(p.defined(), "stagewise::optim::FusedStep: ", slot->describe(),
                " is an undefined tensor. Pass the model's parameters.");
    TORCH_CHECK(p.requires_grad(), "stagewise::optim::FusedStep: ", slot->describe(),
                " does not require grad, so it never gets a gradient to step on. Leave it out "
                "(keep only parameters with requires_grad()) or call requires_grad_(true).");
    TORCH_CHECK(p.is_leaf(), "stagewise::optim::FusedStep: ", slot->describe(),
                " is not a leaf tensor (it has a grad_fn), so autograd accumulates no gradient "
                "into it. Pass the model's parameters, not tensors computed from them.");
    TORCH_CHECK(state->by_impl.emplace(p.unsafeGetTensorImpl(), slot.get()).second,
                "stagewise::optim::FusedStep: ", slot->describe(),
                " is listed twice, so it would step twice per gradient. Pass each parameter once.");
    slot->optimizer = state->factory({p});
    const auto* opt = slot->optimizer.get();
    TORCH_CHECK(opt && opt->param_groups().size() == 1 &&
                    opt->param_groups()[0].params().size() == 1 &&
                    opt->param_groups()[0].params()[0].is_same(p),
                "stagewise::optim::FusedStep: the optimizer factory must return an optimizer "
                "with one param group holding exactly the parameters it is given.");
    state->slots.push_back(std::move(slot));
  }
  return state;
}

}  // namespace stagewise::detail
