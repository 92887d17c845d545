#pragma once

#include "stagewise/optim/detail/fused_slot.hpp"
#include "stagewise/optim/detail/one_parameter.hpp"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <typeinfo>

namespace stagewise::optim {

/// The kind of state a LibTorch optimizer keeps, as a save records it: the type of its options
/// ("torch::optim::AdamOptions"). State saved by one kind loads only into the same kind (Adam's
/// into Adam, fused or not), so a save names the kind it holds.
///   optim::state_kind(adam);  // "torch::optim::AdamOptions"
inline std::string state_kind(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer.defaults()).name());
}

/// Whether `param` is one of `optimizer`'s parameters (in any of its groups).
inline bool keeps_state(const torch::optim::Optimizer& optimizer, const torch::Tensor& param) {
  return detail::group_of(optimizer, param) != nullptr;
}

/// Implemented by a `torch::optim::Optimizer` that keeps some parameters' state outside its
/// `state()` map (`optim::OffloadedOptimizer`: in a store, or in the optimizer it steps the
/// others with), so that `save_state` reaches that state through the base class, as a pipe's save
/// does (`load_state` goes through the optimizer's own `load`, which such an optimizer overrides).
class StateOutsideMap {
 public:
  virtual ~StateOutsideMap() = default;
  /// `param`'s state as the optimizer keeps it (null: none yet).
  virtual std::unique_ptr<torch::optim::OptimizerParamState> state_of(
      const torch::Tensor& param) const = 0;
};

/// Writes `param`'s state in `optimizer` into `archive`, as LibTorch's own optimizer archive of
/// one group holding `param` alone (with its group's options): any optimizer of the same kind
/// reads it back with its own `load`, whatever parameters it holds (`load_state`). A parameter
/// that never stepped is written without state. Returns false, writing nothing, if `param` is not
/// one of `optimizer`'s. LBFGS is refused (one history over all its parameters).
///   torch::serialize::OutputArchive a;
///   optim::save_state(adam, model->parameters()[0], a);
inline bool save_state(const torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                       torch::serialize::OutputArchive& archive) {
  detail::refuse_lbfgs(optimizer, "save_state");
  const auto* group = detail::group_of(optimizer, param);
  if (group == nullptr) return false;
  if (const auto* outside = dynamic_cast<const StateOutsideMap*>(&optimizer)) {
    const auto state = outside->state_of(param);
    detail::write_one_parameter(group->options(), state.get(), archive);
    return true;
  }
  const auto& states = optimizer.state();
  const auto it = states.find(detail::optimizer_state_key(param));
  detail::write_one_parameter(group->options(), it == states.end() ? nullptr : it->second.get(),
                              archive);
  return true;
}

/// `load_state` with the call that reads an archive into the optimizer given (`load(archive)`):
/// for an optimizer whose own `load` takes only whole archives of its kind and reads them
/// through its base class (`distributed::Sharded`), which passes its base class's `load`.
template <class Load>
void load_state_with(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                     torch::serialize::InputArchive& archive, const Load& load) {
  detail::refuse_lbfgs(optimizer, "load_state");
  const auto* group = detail::group_of(optimizer, param);
  TORCH_CHECK(group != nullptr, "stagewise::optim::load_state: a tensor of shape ", param.sizes(),
              " is not one of the optimizer's parameters; give the optimizer over the parameters "
              "you load into");
  detail::AloneInGroups alone(optimizer, param, group->options().clone());
  load(archive);
  alone.take();
}

/// A LibTorch optimizer class whose own `load` reads only whole archives of its kind (as
/// `distributed::Sharded` does, for its share of a model's state) and that reads one
/// parameter's state its own way: `load_state` calls its `load_state` also when it is given as
/// a `torch::optim::Optimizer&`.
class ParameterStateLoad {
 public:
  virtual ~ParameterStateLoad() = default;
  /// Replaces `param`'s state with what `save_state` wrote, as `optim::load_state` does.
  virtual void load_state(const torch::Tensor& param, torch::serialize::InputArchive& archive) = 0;
};

/// Replaces `param`'s state in `optimizer` with the state `archive` holds (written by
/// `save_state` from an optimizer of the same kind, over any parameters): `optimizer`'s own
/// `load` reads it, with `param` alone in its groups for the call, so the other parameters'
/// state and the groups' options (the learning rate a schedule set) stay as they are. A saved
/// parameter without state leaves `param` without state (as never stepped). An error naming
/// the fix if `param` is not one of its parameters; nothing changes on any error.
///   optim::load_state(adam, model->parameters()[0], a);
inline void load_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                       torch::serialize::InputArchive& archive) {
  if (auto* own = dynamic_cast<ParameterStateLoad*>(&optimizer)) {
    own->load_state(param, archive);
    return;
  }
  load_state_with(optimizer, param, archive,
                  [&](torch::serialize::InputArchive& a) { optimizer.load(a); });
}

}  // namespace stagewise::optim
