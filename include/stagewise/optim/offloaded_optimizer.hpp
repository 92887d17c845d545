#pragma once

#include "stagewise/optim/detail/fused_slot.hpp"
#include "stagewise/optim/optimizer_for.hpp"
#include "stagewise/optim/parameter_state.hpp"
#include "stagewise/optim/savable_optimizer.hpp"
#include "stagewise/optim/state_offload.hpp"

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <concepts>
#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise::optim {

/// An unfused optimizer whose state is partly or wholly off the device (`StateOffload`;
/// stagewise's is `runtime::OffloadedState`: a share of the parameters, largest first, their
/// state in a `HostStore` or a `FileStore`): a `torch::optim::Optimizer`, used as one
/// (`step()`, `zero_grad()`, `param_groups()`, a `GradScaler`'s `step(optimizer)`, a pipe's
/// save). `step()` hands each held parameter's gradient to the offload, whose host step is the
/// optimizer's own on CPU tensors, and steps the others on their device, so the result on the CPU
/// is bit-identical to the plain optimizer. The held parameters' updates are applied first, all
/// or none: if one host step fails (a full disk), `step()` throws naming the file and no
/// parameter or state has changed. Saves are in the plain optimizer's layout (one optimizer over
/// all parameters): `torch::load(adam, file)` reads this one's, and this one reads a plain one's.
/// One parameter group.
///   sw::optim::OffloadedOptimizer adam(model->named_parameters(), torch::optim::AdamOptions(1e-3),
///                                      sw::runtime::OffloadedState(sw::runtime::HostStore()));
///   loss.backward(); adam.step(); adam.zero_grad();
class OffloadedOptimizer : public torch::optim::Optimizer, public StateOutsideMap {
 public:
  /// `optimizer_for<Options>` (e.g. `torch::optim::AdamOptions(1e-3)`) over `params`, with
  /// `offload` keeping the state of the parameters it chooses.
  template <fusable_options Options, class Offload>
  requires std::derived_from<std::remove_cvref_t<Offload>, StateOffload> OffloadedOptimizer(
      detail::ParameterList params, Options options, Offload&& offload)
      : OffloadedOptimizer(
            std::move(params), make_optimizer_factory(std::move(options)),
            std::make_shared<std::remove_cvref_t<Offload>>(std::forward<Offload>(offload))) {}

  /// Any optimizer `factory` builds (one group over exactly the parameters it is given, stepping
  /// without a closure, whose state `offload` knows: SGD, Adam, AdamW, RMSprop, Adagrad for
  /// `runtime::OffloadedState`).
  template <class Offload>
  requires std::derived_from<std::remove_cvref_t<Offload>, StateOffload> OffloadedOptimizer(
      detail::ParameterList params, OptimizerFactory factory, Offload&& offload)
      : OffloadedOptimizer(
            std::move(params), std::move(factory),
            std::make_shared<std::remove_cvref_t<Offload>>(std::forward<Offload>(offload))) {}

  /// The same, with an offload shared with its owner.
  OffloadedOptimizer(detail::ParameterList params, OptimizerFactory factory,
                     std::shared_ptr<StateOffload> offload)
      : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                                defaults_of(factory, params.tensors)),
        factory_(std::move(factory)),
        offload_(std::move(offload)) {
    TORCH_CHECK(offload_ != nullptr, who_,
                ": the offload is null; give one (e.g. "
                "runtime::OffloadedState(runtime::HostStore()))");
    add_param_group(torch::optim::OptimizerParamGroup(params.tensors));
    all_ = params.tensors;
    std::vector<std::string> names = params.names;
    names.resize(params.tensors.size());
    offload_->bind(params.tensors, names, factory_);
    std::vector<torch::Tensor> resident;
    for (std::size_t i = 0; i < params.tensors.size(); ++i) {
      if (!offload_->holds(i)) resident.push_back(params.tensors[i]);
    }
    if (!resident.empty()) inner_ = factory_(resident);
  }

  /// Steps every parameter with a gradient (a closure is refused: the step runs in two places):
  /// the held ones on their host steps, whose updates are applied first (all, or none and an
  /// error), then the others on their device.
  torch::Tensor step(LossClosure closure = nullptr) override {
    TORCH_CHECK(!closure, who_,
                "::step: a closure cannot run in two places; call it yourself "
                "before step()");
    const auto& options = param_groups_.at(0).options();
    const auto& params = all_;
    try {
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (offload_->holds(i) && params[i].grad().defined()) {
          offload_->step(i, params[i].grad(), options);
        }
      }
      offload_->finish();
    } catch (...) {
      offload_->abandon();
      throw;
    }
    if (inner_) {
      inner_->param_groups()[0].set_options(options.clone());
      inner_->step();
    }
    return {};
  }

  /// Saves the state in the plain optimizer's layout (the held parameters' from the offload).
  void save(torch::serialize::OutputArchive& archive) const override {
    auto combined = combined_optimizer();
    for (std::size_t i = 0; i < all_.size(); ++i) {
      if (!offload_->holds(i)) continue;
      if (auto s = offload_->state(i)) {
        combined->state()[detail::optimizer_state_key(all_[i])] = std::move(s);
      }
    }
    if (inner_) {
      for (const auto& [key, s] : inner_->state()) combined->state()[key] = s->clone();
    }
    combined->save(archive);
  }

  /// Loads a save of this optimizer or of the plain one over the same parameters (or, as
  /// `optim::load_state` calls it, over the parameters its group holds for the call).
  void load(torch::serialize::InputArchive& archive) override {
    auto combined = combined_optimizer();
    combined->load(archive);
    param_groups_.at(0).set_options(combined->param_groups()[0].options().clone());
    for (const auto& p : param_groups_.at(0).params()) {
      const std::size_t i = index_of(p);
      const auto key = detail::optimizer_state_key(p);
      auto it = combined->state().find(key);
      const bool saved = it != combined->state().end();
      if (offload_->holds(i)) {
        offload_->set_state(i, saved ? std::move(it->second) : nullptr);
      } else if (saved) {
        inner_->state()[key] = std::move(it->second);
      } else {
        inner_->state().erase(key);
      }
    }
  }

  /// `param`'s state, from the store or from the optimizer of the parameters left on their
  /// device (what `optim::save_state` writes for it: a pipe's save).
  std::unique_ptr<torch::optim::OptimizerParamState> state_of(
      const torch::Tensor& param) const override {
    const std::size_t i = index_of(param);
    if (offload_->holds(i)) return offload_->state(i);
    const auto it = inner_->state().find(detail::optimizer_state_key(param));
    return it == inner_->state().end() ? nullptr : it->second->clone();
  }

  /// The offload (e.g. to read its statistics).
  const StateOffload& offload() const { return *offload_; }
  /// Whether parameter `i`'s state is offloaded.
  bool offloaded(std::size_t i) const { return offload_->holds(i); }

 private:
  static std::unique_ptr<torch::optim::OptimizerOptions> defaults_of(
      const OptimizerFactory& factory, const std::vector<torch::Tensor>& params) {
    TORCH_CHECK(static_cast<bool>(factory),
                "stagewise::optim::OffloadedOptimizer: the optimizer "
                "factory is empty; pass options (e.g. torch::optim::AdamOptions(1e-3))");
    TORCH_CHECK(!params.empty(),
                "stagewise::optim::OffloadedOptimizer: no parameters to "
                "optimize; pass model->parameters() or model->named_parameters()");
    auto built = factory({torch::zeros({1}).requires_grad_(true)});  // a probe: no state made
    TORCH_CHECK(built && built->param_groups().size() == 1,
                "stagewise::optim::OffloadedOptimizer: the optimizer factory must return an "
                "optimizer with one param group holding exactly the parameters it is given");
    return built->param_groups()[0].options().clone();
  }

  // The index of `param` among every parameter (as the offload was bound).
  std::size_t index_of(const torch::Tensor& param) const {
    for (std::size_t i = 0; i < all_.size(); ++i) {
      if (all_[i].is_same(param)) return i;
    }
    TORCH_CHECK(false, who_, ": a tensor of shape ", param.sizes(),
                " is not one of the optimizer's parameters");
  }

  // One optimizer over every parameter with the current options and no state: the plain layout.
  std::unique_ptr<torch::optim::Optimizer> combined_optimizer() const {
    auto combined = factory_(param_groups_.at(0).params());
    combined->param_groups()[0].set_options(param_groups_.at(0).options().clone());
    combined->state().clear();
    return combined;
  }

  const char* who_ = "stagewise::optim::OffloadedOptimizer";
  OptimizerFactory factory_;
  std::shared_ptr<StateOffload> offload_;
  std::unique_ptr<torch::optim::Optimizer> inner_;  // over the parameters left on their device
  std::vector<torch::Tensor> all_;                  // every parameter, as the offload was bound
};

}  // namespace stagewise::optim
