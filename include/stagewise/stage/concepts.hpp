#pragma once

#include "stagewise/core/batch.hpp"

#include <torch/types.h>

#include <concepts>
#include <cstddef>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise {

namespace detail {
template <class T>
struct is_tensor_tuple : std::false_type {};
template <class... Ts>
struct is_tensor_tuple<std::tuple<Ts...>>
    : std::bool_constant<(sizeof...(Ts) > 0) && (std::is_same_v<Ts, torch::Tensor> && ...)> {};
}  // namespace detail

/// A value that can flow between stages: a Tensor, a std::tuple of Tensors or a
/// std::vector<Tensor>.
///   static_assert(stagewise::stage_value<std::tuple<torch::Tensor, torch::Tensor>>);
template <class T>
concept stage_value = std::same_as<std::remove_cvref_t<T>, torch::Tensor> ||
                      detail::is_tensor_tuple<std::remove_cvref_t<T>>::value ||
                      std::same_as<std::remove_cvref_t<T>, std::vector<torch::Tensor>>;

namespace detail {

// A LibTorch module holder (TORCH_MODULE type): its operator() is not SFINAE-friendly, so only
// `->forward` is ever probed on it.
template <class S>
concept module_holder = requires { typename S::ContainedType; } && requires(S& s) { s.ptr(); };

// Calls a stage with the given arguments: a module holder (`s->forward(a...)`), a module
// (`s.forward(a...)`) or a callable (`s(a...)`).
template <class S, class... A>
decltype(auto) call_stage(S& s, A&&... a) {
  if constexpr (module_holder<S>) {
    if constexpr (requires { s->forward(std::forward<A>(a)...); }) {
      return s->forward(std::forward<A>(a)...);
    } else {
      return;
    }
  } else if constexpr (requires { s.forward(std::forward<A>(a)...); }) {
    return s.forward(std::forward<A>(a)...);
  } else if constexpr (std::invocable<S&, A...>) {
    return std::invoke(s, std::forward<A>(a)...);
  } else {
    return;  // not callable this way: stage_of is false
  }
}

template <class S, class... A>
concept callable_stage_with = !std::is_void_v<decltype(call_stage(std::declval<S&>(),
                                                                  std::declval<A>()...))>;

// Calls a stage with one value; a tuple is unpacked when the stage takes its elements separately.
template <class S, class In>
decltype(auto) invoke_stage(S& s, In&& in) {
  if constexpr (callable_stage_with<S, In>) {
    return call_stage(s, std::forward<In>(in));
  } else if constexpr (is_tensor_tuple<std::remove_cvref_t<In>>::value) {
    return std::apply(
        [&](auto&&... e) -> decltype(auto) {
          if constexpr (callable_stage_with<S, decltype(e)...>) {
            return call_stage(s, std::forward<decltype(e)>(e)...);
          } else {
            return;
          }
        },
        std::forward<In>(in));
  } else {
    return;
  }
}

// The argument type a stage declares, when its forward / operator() is not overloaded.
template <class F>
struct signature_input {
  using type = torch::Tensor;  // overloaded or generic: assume a Tensor
};
template <class C, class R, class... A>
struct signature_input<R (C::*)(A...)> {
  using type = std::conditional_t<sizeof...(A) == 1,
                                  std::remove_cvref_t<std::tuple_element_t<0, std::tuple<A..., void>>>,
                                  std::tuple<std::remove_cvref_t<A>...>>;
};
template <class C, class R, class... A>
struct signature_input<R (C::*)(A...) const> : signature_input<R (C::*)(A...)> {};

template <class S>
auto declared_input() {
  if constexpr (requires { &std::remove_cvref_t<decltype(*std::declval<S&>().operator->())>::forward; }) {
    return typename signature_input<
        decltype(&std::remove_cvref_t<decltype(*std::declval<S&>().operator->())>::forward)>::type{};
  } else if constexpr (requires { &S::forward; }) {
    return typename signature_input<decltype(&S::forward)>::type{};
  } else if constexpr (requires { &S::operator(); }) {
    return typename signature_input<decltype(&S::operator())>::type{};
  } else {
    return torch::Tensor{};
  }
}

}  // namespace detail

/// A stage `S` accepts `In` and returns a stage_value.
///   static_assert(stagewise::stage_of<torch::nn::Linear, torch::Tensor>);
template <class S, class In>
concept stage_of = requires(S& s, In&& in) {
  { detail::invoke_stage(s, std::forward<In>(in)) } -> stage_value;
};

/// The input type a stage declares (its forward's parameter; a tuple for several Tensors).
template <class S>
using stage_input_t = decltype(detail::declared_input<S>());

/// What stage `S` returns for `In`.
template <class S, class In>
  requires stage_of<S, In>
using stage_output_t =
    std::remove_cvref_t<decltype(detail::invoke_stage(std::declval<S&>(), std::declval<In>()))>;

/// A pipeline stage: a LibTorch module holder (torch::nn::Sequential, a TORCH_MODULE type, ...) or
/// a callable whose forward takes and returns tensors (a Tensor, a tuple or a vector of them).
///   static_assert(stagewise::stage<torch::nn::Sequential>);  static_assert(!stagewise::stage<int>);
template <class S>
concept stage = std::copy_constructible<S> && stage_value<stage_input_t<S>> &&
                stage_of<S, stage_input_t<S>>;

namespace detail {

// Batch <-> typed stage values.
template <class T>
T from_batch(const Batch& b, const std::string& where) {
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    TORCH_CHECK(b.size() == 1, "stagewise::Pipe: ", where, " takes one Tensor but receives ",
                b.size(), " tensors");
    return b[0];
  } else if constexpr (std::is_same_v<T, std::vector<torch::Tensor>>) {
    return std::vector<torch::Tensor>(b.begin(), b.end());
  } else {
    constexpr std::size_t n = std::tuple_size_v<T>;
    TORCH_CHECK(b.size() == n, "stagewise::Pipe: ", where, " takes a tuple of ", n,
                " tensors but receives ", b.size());
    return [&]<std::size_t... I>(std::index_sequence<I...>) { return T{b[I]...}; }(
        std::make_index_sequence<n>{});
  }
}

template <class T>
Batch to_batch(T&& value) {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    return Batch(std::forward<T>(value));
  } else if constexpr (std::is_same_v<U, std::vector<torch::Tensor>>) {
    return Batch(std::vector<torch::Tensor>(std::forward<T>(value)));
  } else {
    return std::apply([](auto&&... e) { return Batch(std::vector<torch::Tensor>{e...}); },
                      std::forward<T>(value));
  }
}

}  // namespace detail
}  // namespace stagewise
