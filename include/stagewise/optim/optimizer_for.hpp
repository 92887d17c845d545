#pragma once

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <concepts>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise::optim {

/// Builds one `torch::optim` optimizer over the parameters it is given. `FusedStep` calls it once
/// per parameter (a one-parameter group) and, to save or load state, once over all of them.
///   OptimizerFactory f = [](std::vector<torch::Tensor> p) {
///     return std::make_unique<torch::optim::RMSprop>(std::move(p),
///     torch::optim::RMSpropOptions(0.01));
///   };
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

/// Maps an options type to the optimizer it configures (`SGDOptions` -> `SGD`, ...). Specialize it
/// for your own optimizer to pass its options straight to `FusedStep`.
///   template <> struct stagewise::optim::optimizer_for<MyOptions> { using type = MyOptimizer; };
template <class Options>
struct optimizer_for {};

template <>
struct optimizer_for<torch::optim::SGDOptions> {
  using type = torch::optim::SGD;
};
template <>
struct optimizer_for<torch::optim::AdamOptions> {
  using type = torch::optim::Adam;
};
template <>
struct optimizer_for<torch::optim::AdamWOptions> {
  using type = torch::optim::AdamW;
};
template <>
struct optimizer_for<torch::optim::RMSpropOptions> {
  using type = torch::optim::RMSprop;
};
template <>
struct optimizer_for<torch::optim::AdagradOptions> {
  using type = torch::optim::Adagrad;
};

/// True for an options type whose optimizer can run per parameter without a closure: the ones
/// `optimizer_for` maps (LBFGS is not one: its step needs the loss closure).
///   static_assert(fusable_options<torch::optim::AdamOptions>);
template <class Options>
concept fusable_options = requires {
  typename optimizer_for<std::remove_cvref_t<Options>>::type;
}
&&std::derived_from<typename optimizer_for<std::remove_cvref_t<Options>>::type,
                    torch::optim::Optimizer>&&
    std::constructible_from<typename optimizer_for<std::remove_cvref_t<Options>>::type,
                            std::vector<torch::Tensor>, std::remove_cvref_t<Options>>;

/// The factory that builds `optimizer_for<Options>` with a copy of `options`.
///   auto factory = stagewise::optim::make_optimizer_factory(torch::optim::AdamOptions(1e-3));
template <fusable_options Options>
OptimizerFactory make_optimizer_factory(Options options) {
  using Optimizer = typename optimizer_for<std::remove_cvref_t<Options>>::type;
  return [options = std::move(options)](std::vector<torch::Tensor> params) {
    return std::unique_ptr<torch::optim::Optimizer>(
        std::make_unique<Optimizer>(std::move(params), options));
  };
}

}  // namespace stagewise::optim
