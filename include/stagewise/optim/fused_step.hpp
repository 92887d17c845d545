#pragma once

#include "stagewise/optim/detail/fused_saves.hpp"
#include "stagewise/optim/detail/fused_slot.hpp"
#include "stagewise/optim/optimizer_for.hpp"
#include "stagewise/optim/parameter_state.hpp"
#include "stagewise/optim/savable_optimizer.hpp"
#include "stagewise/optim/state_offload.hpp"

#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise {
namespace detail {
struct FusedStepAccess;  // defined by clip.hpp, which drives the norm pass
}  // namespace detail

namespace optim {

/// The optimizer step fused into backward (LOMO-style): each parameter is updated the moment its
/// gradient is final, and the gradient is freed at once, so gradient memory falls from the whole
/// model to about one tensor. Bit-identical to the unfused optimizer for optimizers without
/// cross-parameter coupling (SGD, Adam, AdamW, RMSprop, Adagrad): each parameter gets its own
/// optimizer over a one-parameter group.
///
/// Use it in place of `optimizer.step(); optimizer.zero_grad();`:
///   sw::optim::FusedStep fused(model->named_parameters(), torch::optim::AdamOptions(1e-3));
///   for (...) { loss_fn(model->forward(x), y).backward(); }  // parameters updated, .grad empty
///
/// A parameter steps on its k-th gradient since its last step (k = `set_accumulation_steps`,
/// default 1): one per backward pass that reaches it. With micro-batches (gradient accumulation,
/// a pipeline stage's M backward passes) set k to their number; gradients are then held, as
/// usual, until the last one. A parameter that gets no gradient in a step does not step, as
/// with an unfused optimizer whose gradients are reset to none (`zero_grad()` in LibTorch 2.x;
/// 1.13's zeroes them instead: reset them by hand, `p.mutable_grad().reset()`, to compare).
/// `finish_step()` steps parameters that got fewer than k and reports one that stepped twice.
///
/// Threads: a parameter's hook runs on the thread running its backward; different parameters
/// may step concurrently on different threads (one pipeline stage each), with no shared lock.
/// One parameter must not get gradients from two threads in one step. Call the other member
/// functions between steps, not while a backward pass is running.
class FusedStep {
 public:
  /// Fuses `optimizer_for<Options>` (e.g. `torch::optim::SGDOptions(0.1).momentum(0.9)`).
  template <fusable_options Options>
  FusedStep(detail::ParameterList params, Options options)
      : FusedStep(std::move(params), make_optimizer_factory(std::move(options))) {}

  /// Fuses any optimizer the factory builds (it must build one group over exactly the
  /// parameters it is given, and step without a closure).
  FusedStep(detail::ParameterList params, OptimizerFactory factory)
      : state_(detail::make_fused_state(std::move(params), std::move(factory))) {
    attach();
  }

  FusedStep(FusedStep&&) noexcept = default;
  FusedStep& operator=(FusedStep&& other) noexcept {
    if (this != &other) {
      if (state_) detach();
      state_ = std::move(other.state_);
    }
    return *this;
  }
  /// Removes every hook: no hook outlives its FusedStep.
  ~FusedStep() {
    if (state_) detach();
  }

  /// Makes every parameter step on its k-th gradient (k >= 1): k backward passes per step, e.g.
  /// the number of micro-batches. Gradient memory is then saved only on the k-th pass. Between
  /// steps only.
  void set_accumulation_steps(int k) {
    check_between_steps("set_accumulation_steps");
    check_steps(k);
    rehook_replaced();  // a pipe calls this before each step: hooks are in place for its backward
    for (auto& slot : state().slots) slot->accumulation_steps = k;
  }

  /// Sets k for some parameters only: for one that receives several gradients per backward
  /// pass (a layer checkpointed twice with reentrant recompute delivers one per recompute).
  ///   fused.set_accumulation_steps(2, shared_layer->parameters());
  void set_accumulation_steps(int k, const std::vector<torch::Tensor>& params) {
    check_between_steps("set_accumulation_steps");
    check_steps(k);
    for (const auto& p : params) find(p, "set_accumulation_steps").accumulation_steps = k;
  }

  /// Ends a step (a pipeline calls it after its last backward). A parameter that got fewer than
  /// k gradients (k = `set_accumulation_steps`; some micro-batches did not reach it) steps now on
  /// their sum; one that got none does not step. Both are what an unfused optimizer does with
  /// gradients reset to none between steps, and both are normal, e.g. for the experts of a
  /// mixture-of-experts layer that got no tokens. Throws, naming the parameters, only if one got
  /// more than k gradients (it stepped more than once: k is wrong, or a layer recomputed twice
  /// needs `set_accumulation_steps(2 * k, params)`); in strict mode (`set_strict(true)`) also if
  /// one got fewer than k. Then resets the per-step counts; before throwing it frees pending
  /// gradients unused, so the next step starts clean.
  ///   loss.backward();
  ///   fused.finish_step();
  void finish_step() {
    auto& st = state();
    TORCH_CHECK(
        st.attached,
        "stagewise::optim::FusedStep::finish_step: the fused step is detached, so no "
        "parameter stepped. Call attach() before the step, or step the optimizer yourself.");
    // A parameter whose tensor was replaced in place (set_, as torch::load(module, ...) does)
    // has a new AccumulateGrad node without the hook: its gradients of this step are in .grad,
    // unseen. It steps on them now, as the unfused optimizer would, and is hooked again.
    for (const auto& slot : rehook_replaced()) {
      if (slot->arrivals.load() == 0 && slot->updates.load() == 0 && slot->param.grad().defined()) {
        slot->use_gradient();
      }
    }
    const bool strict = st.shared.strict;
    std::ostringstream problems;
    int count = 0;
    for (const auto& slot : st.slots) {
      const int pending = slot->arrivals.load();
      const int updates = slot->updates.load();
      const int k = slot->accumulation_steps;
      if (updates > 1 || (updates == 1 && pending > 0)) {
        problems << (count++ ? "; " : "") << slot->describe() << " stepped " << updates
                 << (updates == 1 ? " time" : " times");
        if (pending > 0) problems << " and then got " << pending << " more gradients";
      } else if (strict && updates == 0) {
        problems << (count++ ? "; " : "") << slot->describe();
        if (pending == 0) {
          problems << " got no gradient";
        } else {
          problems << " got " << pending << " of its " << k << " gradients";
        }
      }
    }
    if (count > 0) {
      reset_step();
      TORCH_CHECK(
          !strict, "stagewise::optim::FusedStep::finish_step (strict): ", count, " of ",
          st.slots.size(),
          " parameters did not get exactly k gradients and step once: ", problems.str(),
          ". Set set_accumulation_steps(k) to the number of backward passes per step and "
          "set_accumulation_steps(k, params) for parameters that get several gradients per "
          "backward (a layer recomputed twice). A parameter that is not used in every step (an "
          "expert that got no tokens) is normal: call set_strict(false) to let it skip the step, "
          "as unfused optimizers do.");
      TORCH_CHECK(false, "stagewise::optim::FusedStep::finish_step: ", count, " of ",
                  st.slots.size(), " parameters stepped more than once this step: ", problems.str(),
                  ". Set set_accumulation_steps(k) to the number of backward passes per step, "
                  "and set_accumulation_steps(k, params) for parameters that get several "
                  "gradients per backward (a layer recomputed twice).");
    }
    for (auto& slot : st.slots) slot->flush();
    finish_offload();
    reset_counts();  // not reset_step: a norm pass (clip_grad_norm_step) still needs the norms
  }

  /// Strict mode for `finish_step`: also report a parameter that got fewer gradients than k in a
  /// step, none included, instead of letting it skip the step. Use it to catch a dead branch (a
  /// layer the loss never reaches). Off by default. Between steps only.
  ///   fused.set_strict(true);  // every parameter must get a gradient every step
  void set_strict(bool strict) {
    check_between_steps("set_strict");
    state().shared.strict = strict;
  }
  /// True in strict mode; see `set_strict`.
  bool strict() const { return state().shared.strict; }

  /// Forgets the current step (e.g. after an exception mid-backward): pending gradients are
  /// freed and the counts reset; optimizer state is kept.
  void reset_step() {
    if (state().offload) state().offload->abandon();  // nothing of the step is applied
    for (auto& slot : state().slots) {
      slot->norm = torch::Tensor();
      slot->has_norm = false;
    }
    reset_counts();
  }

  /// How many parameters have stepped since the last `finish_step` / `reset_step`.
  std::int64_t stepped_this_step() const { return state().shared.updated.load(); }

  /// Sets the learning rate of every per-parameter optimizer (what a scheduler changes).
  ///   fused.set_lr(base_lr * std::pow(0.5, epoch / 10));
  void set_lr(double lr) {
    for (auto& slot : state().slots) {
      for (auto& group : slot->optimizer->param_groups()) group.options().set_lr(lr);
    }
  }
  /// The current learning rate.
  double lr() const {
    return state().slots.front()->optimizer->param_groups()[0].options().get_lr();
  }

  /// Installs the hooks again after `detach()` (construction attaches). Optimizer state is kept.
  /// While attached, hooks again the parameters whose tensors were given other storage in place
  /// since: `torch::load(module, file)` does that (set_), and autograd then forgets the hook.
  /// `finish_step()` and `set_accumulation_steps(k)` do this too, and `finish_step()` also steps
  /// a parameter on the gradients its lost hook missed; without them, call attach() after
  /// loading a module.
  ///   torch::load(model, "model.pt");
  ///   fused.attach();
  void attach() {
    auto& st = state();
    if (st.attached) {
      rehook_replaced();
      return;
    }
    try {
      for (auto& slot : st.slots) {
        // The tensor holds its AccumulateGrad node only weakly: keep it alive, or the next
        // forward builds a new node without the hook.
        auto node = torch::autograd::impl::grad_accumulator(slot->param);
        TORCH_CHECK(node, "stagewise::optim::FusedStep::attach: ", slot->describe(),
                    " no longer requires grad. Call requires_grad_(true) on it first.");
        slot->hook_key = node->add_post_hook(std::make_unique<detail::FusedPostHook>(slot.get()));
        slot->accumulator = std::move(node);
        slot->arrivals.store(0);
      }
    } catch (...) {
      detach();  // no hook may outlive a failed attach
      throw;
    }
    st.attached = true;
  }

  /// Removes the hooks: backward fills `.grad` again, as without a FusedStep. Pending
  /// (accumulating) gradients stay in `.grad`.
  void detach() {
    auto& st = state();
    for (auto& slot : st.slots) {
      if (slot->accumulator) slot->accumulator->del_post_hook(slot->hook_key);
      slot->accumulator.reset();
      slot->arrivals.store(0);
    }
    st.attached = false;
  }
  /// True while the hooks are installed.
  bool attached() const { return state().attached; }

  /// The parameters, in order.
  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> out;
    for (const auto& slot : state().slots) out.push_back(slot->param);
    return out;
  }
  /// The number of parameters.
  std::size_t size() const { return state().slots.size(); }
  /// The optimizer of parameter `i` (one group, one parameter), e.g. to read its state.
  torch::optim::Optimizer& optimizer(std::size_t i) { return *state().slots.at(i)->optimizer; }

  /// The index of parameter `p` (as `parameters()` lists them); an error naming the fix if `p`
  /// is not one of them.
  std::size_t index_of(const torch::Tensor& p, const char* what = "index_of") {
    return find(p, what).index;
  }

  /// Steps parameter `i` on its gradient now and frees it, as its hook does on its last
  /// gradient: for a caller that decides when a gradient is final, with the hooks detached
  /// (`distributed::DataParallel` steps each parameter once its averaged gradient is written).
  /// A parameter without a gradient does not step. Not counted by `finish_step`.
  void step_parameter(std::size_t i) {
    auto& slot = *state().slots.at(i);
    TORCH_CHECK(!state().attached,
                "stagewise::optim::FusedStep::step_parameter: the hooks are "
                "attached, so parameters step from backward already; call detach() first");
    slot.use_gradient();
    slot.updates.fetch_sub(1, std::memory_order_relaxed);
    state().shared.updated.fetch_sub(1, std::memory_order_relaxed);
    // An offloaded parameter is updated once its host step is done (a pipe's data-parallel step
    // defers that to the step's end, where it finishes them all).
    if (slot.offloaded && !state().shared.defer_offload_finish) state().offload->finish();
  }

  /// Keeps the optimizer state of some parameters off their device, where their step runs too
  /// (`runtime::OffloadedState`: a share of them, largest first, in a `HostStore` or a
  /// `FileStore`, stepped on host threads beside backward; bit-identical on the CPU). Their new
  /// values are written back by `finish_step()`, which each step then needs; a step updates all
  /// of them or, if a host step fails, none. State already made moves into it. Once, between
  /// steps. See docs/memory.md, "The model's state".
  ///   fused.offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore(), /*share=*/1.0));
  template <class Offload>
  requires std::derived_from<std::remove_cvref_t<Offload>, StateOffload>
  void offload_state(Offload&& offload) {
    install(std::make_shared<std::remove_cvref_t<Offload>>(std::forward<Offload>(offload)));
  }
  /// Whether `offload_state` was given, and whether it holds parameter `i`'s state.
  bool offloads_state() const { return state().offload != nullptr; }
  bool offloaded(std::size_t i) const { return state().slots.at(i)->offloaded; }

  /// Saves the state in the unfused optimizer's layout: one optimizer over all parameters, in
  /// order, so `torch::load(unfused, file)` reads it and `torch::load(fused, file)` reads an
  /// unfused one's. `torch::save(fused, file)` calls this.
  void save(torch::serialize::OutputArchive& archive) const {
    detail::save_fused(state(), archive);
  }

  /// The kind of state it keeps: its optimizer's options type, as the unfused optimizer's
  /// (`optim::state_kind`), so that a pipe's save made with one loads into the other.
  std::string state_kind() const { return optim::state_kind(*state().slots.front()->optimizer); }
  /// Whether it keeps `param`'s state: one of its parameters (sharded over data-parallel
  /// replicas, one this replica owns).
  bool keeps_state(const torch::Tensor& param) const {
    const auto* slot = slot_of(param);
    return slot != nullptr && state().owns(slot->index);
  }
  /// Writes parameter `param`'s state as the unfused optimizer's `optim::save_state` does (one
  /// parameter in LibTorch's layout), or returns false if `param` is not one of its parameters:
  /// a pipe's save files it under the parameter's name.
  bool save_state(const torch::Tensor& param, torch::serialize::OutputArchive& archive) const {
    const auto* slot = slot_of(param);
    return slot != nullptr && state().owns(slot->index) &&
           detail::save_slot(state(), *slot, archive);
  }
  /// Replaces parameter `param`'s state with what `save_state` wrote (this FusedStep's, another's
  /// or an unfused optimizer's of the same kind, over any parameters). Between steps only.
  void load_state(const torch::Tensor& param, torch::serialize::InputArchive& archive) {
    check_between_steps("load_state");
    detail::load_slot(state(), find(param, "load_state"), archive);
  }

  /// Loads state saved by `save` or by the unfused optimizer over the same parameters. Sharded
  /// over data-parallel replicas (`distributed::DataParallel::step_with`, the 2-D pipe with
  /// `shard_optimizer_state`), it keeps the state of the parameters this replica owns and
  /// refuses, naming it and changing nothing, an owned parameter without state in an archive
  /// that holds state for others (a save of another shard, or of another model).
  void load(torch::serialize::InputArchive& archive) { detail::load_fused(state(), archive); }

 private:
  // The per-step counts and pending gradients, cleared; the norms of a norm pass are kept.
  void reset_counts() {
    auto& st = state();
    for (auto& slot : st.slots) {
      slot->arrivals.store(0);
      slot->updates.store(0);
      slot->param.mutable_grad().reset();
    }
    st.shared.updated.store(0);
  }

  // Ends the offloaded parameters' step (their updates applied, or none and an error).
  void finish_offload() {
    if (!state().offload) return;
    try {
      state().offload->finish();
    } catch (...) {
      reset_counts();
      throw;
    }
  }

  // offload_state's work (between steps only; detail::install_offload).
  void install(std::shared_ptr<StateOffload> offload) {
    TORCH_CHECK(!state().offload, "stagewise::optim::FusedStep::offload_state: the state is "
                "offloaded already (", state().offload ? state().offload->describe() : "",
                "); give a FusedStep one offload, once");
    check_between_steps("offload_state");
    detail::install_offload(state(), std::move(offload));
  }

  friend struct detail::FusedStepAccess;

  detail::FusedState& state() {
    TORCH_CHECK(state_, "stagewise::optim::FusedStep: used after being moved from.");
    return *state_;
  }
  const detail::FusedState& state() const {
    TORCH_CHECK(state_, "stagewise::optim::FusedStep: used after being moved from.");
    return *state_;
  }

  static void check_steps(int k) {
    TORCH_CHECK(k >= 1, "stagewise::optim::FusedStep::set_accumulation_steps: k = ", k,
                "; a parameter needs at least one gradient per step. Pass k >= 1.");
  }

  void check_between_steps(const char* what) const {
    for (const auto& slot : state().slots) {
      TORCH_CHECK(slot->arrivals.load() == 0, "stagewise::optim::FusedStep::", what, ": ",
                  slot->describe(),
                  " is part-way through accumulating. Call it between steps "
                  "(after finish_step() or reset_step()).");
    }
  }

  // The slot of parameter `p`, or null (the slots are the state's, not this object's: a const
  // FusedStep may hand one out).
  detail::FusedSlot* slot_of(const torch::Tensor& p) const {
    const auto& by_impl = state().by_impl;
    const auto it = by_impl.find(p.unsafeGetTensorImpl());
    return it == by_impl.end() ? nullptr : it->second;
  }

  detail::FusedSlot& find(const torch::Tensor& p, const char* what) {
    if (auto* slot = slot_of(p)) return *slot;
    TORCH_CHECK(false, "stagewise::optim::FusedStep::", what, ": a tensor of shape ", p.sizes(),
                " is not one of this FusedStep's parameters. Pass parameters it was built with.");
  }

  // Moves the hook of every parameter whose AccumulateGrad node was replaced since it was hooked
  // (its tensor was set_ to other storage: the tensor keeps its node only weakly, and set_ drops
  // it) onto the new node; returns those parameters' slots.
  std::vector<detail::FusedSlot*> rehook_replaced() {
    std::vector<detail::FusedSlot*> moved;
    auto& st = state();
    if (!st.attached) return moved;
    for (auto& slot : st.slots) {
      auto node = torch::autograd::impl::grad_accumulator(slot->param);
      if (!node || node == slot->accumulator) continue;
      if (slot->accumulator) slot->accumulator->del_post_hook(slot->hook_key);
      slot->hook_key = node->add_post_hook(std::make_unique<detail::FusedPostHook>(slot.get()));
      slot->accumulator = std::move(node);
      moved.push_back(slot.get());
    }
    return moved;
  }

  std::unique_ptr<detail::FusedState> state_;
};

/// `torch::save(fused, path)`: see `FusedStep::save`.
inline torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                                   const FusedStep& fused) {
  fused.save(archive);
  return archive;
}

/// `torch::load(fused, path)`: see `FusedStep::load`.
inline torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                                  FusedStep& fused) {
  fused.load(archive);
  return archive;
}

}  // namespace optim

static_assert(parameter_state_optimizer<optim::FusedStep>);
static_assert(savable_optimizer<optim::FusedStep>);

}  // namespace stagewise
