#pragma once

#include "stagewise/skip/namespace.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/skip/tracker.hpp"
#include "stagewise/skip/detail/type_list.hpp"
#include "stagewise/stage/concepts.hpp"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace stagewise {

namespace detail {
template <std::size_t Index, class L, class In>
struct check_seq_link {
  static_assert(
      stage_of<L, In>,
      "stagewise::seq: a layer cannot take the output of the layer before it (the "
      "layer's index is the first number in 'check_seq_link<Index, ...>' above, the value "
      "it is given the last). Make its forward accept that type, or change what the "
      "earlier layer returns.");
  static constexpr bool value = true;
};

template <class L>
std::string layer_name(L& layer) {
  if constexpr (module_holder<L>) {
    return layer->name();
  } else {
    return type_name<L>();
  }
}
}  // namespace detail

/// The module behind `seq`: layers of known types called one after another.
template <class... L>
class SeqImpl : public torch::nn::Module {
  static_assert(sizeof...(L) > 0, "stagewise::seq: give at least one layer");
  using first_layer = std::tuple_element_t<0, std::tuple<L...>>;
  using all_stashes = detail::concat_t<typename skip_declarations<L>::stash_list...>;
  using all_pops = detail::concat_t<typename skip_declarations<L>::pop_list...>;

 public:
  using input_type = stage_input_t<first_layer>;
  /// What the sequence as a whole stashes and pops: the skips that leave it or enter it (a skip
  /// stashed and popped inside is its own business).
  using stash_list = detail::subtract_t<all_stashes, all_pops>;
  using pop_list = detail::subtract_t<all_pops, all_stashes>;

  explicit SeqImpl(L... layers) : layers_(std::move(layers)...) {
    register_layers(std::index_sequence_for<L...>{});
  }

  /// Runs the layers in order; a Skippable layer's stashes and pops are checked against its
  /// declarations while it runs.
  auto forward(input_type x) { return call<0>(std::move(x)); }

  /// The layers.
  std::tuple<L...>& layers() { return layers_; }

 private:
  template <std::size_t... I>
  void register_layers(std::index_sequence<I...>) {
    (register_one(std::to_string(I), std::get<I>(layers_)), ...);
  }
  template <class T>
  void register_one(const std::string& name, T& layer) {
    if constexpr (detail::module_holder<T>) register_module(name, layer);
  }

  template <std::size_t I, class In>
  auto call(In&& x) {
    using Layer = std::tuple_element_t<I, std::tuple<L...>>;
    static_assert(detail::check_seq_link<I, Layer, In>::value);
    if constexpr (stage_of<Layer, In>) {
      auto y = run_layer(std::get<I>(layers_), std::forward<In>(x));
      if constexpr (I + 1 < sizeof...(L)) {
        return call<I + 1>(std::move(y));
      } else {
        return y;
      }
    } else {
      return x;  // not reached: the static_assert above has failed
    }
  }

  template <class Layer, class In>
  static auto run_layer(Layer& layer, In&& x) {
    if constexpr (skippable<Layer>) {
      using traits = skip_declarations<Layer>;
      static const detail::SkipDeclarations declared{
          detail::infos_of<typename traits::stash_list>::get(),
          detail::infos_of<typename traits::pop_list>::get()};
      detail::LayerFrame frame(declared, [&layer] { return detail::layer_name(layer); });
      auto y = detail::invoke_stage(layer, std::forward<In>(x));
      frame.finish();
      return y;
    } else {
      return detail::invoke_stage(layer, std::forward<In>(x));
    }
  }

  std::tuple<L...> layers_;
};

/// A stage made of layers whose types are known at compile time, for typed pipes: a `Pipe` over
/// `seq`s checks the stash/pop pairing of every layer inside them, layer by layer, and each
/// layer's forward must accept what the layer before it returns.
///   auto pipe = stagewise::Pipe(stagewise::stages(stagewise::seq(down1, down2),
///                                                 stagewise::seq(up2, up1, head)));
template <class... L>
class seq : public torch::nn::ModuleHolder<SeqImpl<L...>> {
  using holder = torch::nn::ModuleHolder<SeqImpl<L...>>;

 public:
  /// The layer types, in order (the compile-time skip checks look inside).
  using layer_types = detail::type_list<L...>;

  /// A sequence of these layers (module holders are shared, not copied).
  explicit seq(L... layers) : holder(std::make_shared<SeqImpl<L...>>(std::move(layers)...)) {}
  /// An empty holder, to assign later.
  seq(std::nullptr_t) : holder(nullptr) {}  // NOLINT(implicit)
  explicit seq(std::shared_ptr<SeqImpl<L...>> impl) : holder(std::move(impl)) {}
};

template <class... L>
seq(L...) -> seq<L...>;

}  // namespace stagewise
