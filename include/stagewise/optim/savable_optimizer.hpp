#pragma once

#include "stagewise/optim/parameter_state.hpp"

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <concepts>
#include <string>

namespace stagewise {

/// An optimizer that saves and loads its state one parameter at a time, which is what lets a
/// pipe's save file optimizer state under the model's own names and load it into another split
/// of the model: `optim::FusedStep`, and an optimizer of your own with these members:
/// - `state_kind()`: the kind of state it keeps (saved, and compared on load);
/// - `keeps_state(p)`: whether it keeps `p`'s state (one of its parameters; an optimizer holding
///   a share of a stage's state keeps only its share's);
/// - `save_state(p, archive)`: writes `p`'s state, or returns false if it keeps none of `p`;
/// - `load_state(p, archive)`: replaces `p`'s state with what `save_state` wrote (by any optimizer
///   of the same kind over any parameters).
///   static_assert(stagewise::parameter_state_optimizer<stagewise::optim::FusedStep>);
template <class O>
concept parameter_state_optimizer = requires(const O& saved, O& loaded, const torch::Tensor& param,
                                             torch::serialize::OutputArchive& out,
                                             torch::serialize::InputArchive& in) {
  { saved.state_kind() } -> std::convertible_to<std::string>;
  { saved.keeps_state(param) } -> std::same_as<bool>;
  { saved.save_state(param, out) } -> std::same_as<bool>;
  loaded.load_state(param, in);
};

/// An optimizer whose state a pipe's save keeps and its load restores: any LibTorch optimizer
/// (`torch::optim::Adam`, `SGD`, ...: every `torch::optim::Optimizer` but LBFGS, whose one
/// history over all parameters is refused when saved), `optim::FusedStep`, or any
/// `parameter_state_optimizer`.
///   pipe->save(dir, optimizer, step);   // optimizer: savable_optimizer
template <class O>
concept savable_optimizer =
    std::derived_from<O, torch::optim::Optimizer> || parameter_state_optimizer<O>;

namespace optim {

/// `state_kind`, `keeps_state`, `save_state` and `load_state` of a `parameter_state_optimizer`
/// (its members), beside the same functions for LibTorch's optimizers (parameter_state.hpp): a
/// pipe's save calls them on any `savable_optimizer`.
template <parameter_state_optimizer O>
std::string state_kind(const O& optimizer) {
  return optimizer.state_kind();
}
template <parameter_state_optimizer O>
bool keeps_state(const O& optimizer, const torch::Tensor& param) {
  return optimizer.keeps_state(param);
}
template <parameter_state_optimizer O>
bool save_state(const O& optimizer, const torch::Tensor& param,
                torch::serialize::OutputArchive& archive) {
  return optimizer.save_state(param, archive);
}
template <parameter_state_optimizer O>
void load_state(O& optimizer, const torch::Tensor& param, torch::serialize::InputArchive& archive) {
  optimizer.load_state(param, archive);
}

}  // namespace optim
}  // namespace stagewise
