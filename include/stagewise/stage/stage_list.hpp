#pragma once

#include "stagewise/stage/concepts.hpp"
#include "stagewise/core/detail/stage_spec.hpp"

#include <torch/nn/module.h>

#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise {

namespace detail {

template <std::size_t Index, class S>
struct check_is_stage {
  static_assert(stage<S>,
                "stagewise::stages: this argument is not a stage (its index is the first number in "
                "'check_is_stage<Index, ...>' above). A stage is a LibTorch module holder (a "
                "TORCH_MODULE type, torch::nn::Sequential, ...) or a callable whose forward takes "
                "and returns a torch::Tensor, a std::tuple of Tensors or a std::vector<Tensor>.");
  static constexpr bool value = true;
};

template <std::size_t Index, class S, class In>
struct check_stage_link {
  static_assert(stage_of<S, In>,
                "stagewise::Pipe: a stage cannot take the output of the stage before it (the "
                "stage's index is the first number in 'check_stage_link<Index, ...>' above, the "
                "value it is given the last). Make its forward accept that type, or change what "
                "the earlier stage returns.");
  using output = typename decltype([] {
    if constexpr (stage_of<S, In>) {
      return std::type_identity<stage_output_t<S, In>>{};
    } else {
      return std::type_identity<torch::Tensor>{};
    }
  }())::type;
};

template <class... S, std::size_t... I>
constexpr bool all_stages(std::index_sequence<I...>) {
  return (check_is_stage<I, S>::value && ...);
}

struct no_chain {
  using output = torch::Tensor;
};

// Walks the stage list at compile time: each stage must accept what the previous one returns.
template <std::size_t Index, class In, class... S>
struct chain {
  using input = In;
  using output = In;
};
template <std::size_t Index, class In, class First, class... Rest>
struct chain<Index, In, First, Rest...> {
  using link = check_stage_link<Index, First, In>;
  using output = typename chain<Index + 1, typename link::output, Rest...>::output;
};

template <class S>
std::shared_ptr<torch::nn::Module> module_of(S& s) {
  if constexpr (module_holder<S>) {
    return s.ptr();
  } else {
    return nullptr;
  }
}

template <class S, class In>
StageSpec erase_stage(S s, std::size_t index) {
  StageSpec spec;
  spec.name = "stage " + std::to_string(index);
  spec.module = module_of(s);
  spec.fn = [s = std::move(s), where = spec.name](const Batch& b) mutable {
    return to_batch(invoke_stage(s, from_batch<In>(b, where)));
  };
  return spec;
}

}  // namespace detail

/// A compile-time list of pipeline stages, made by `stagewise::stages(...)`; each stage is
/// checked to accept what the stage before it returns.
///   auto list = stagewise::stages(embed, blocks, head);  // stage_list<Embedding, Sequential, Linear>
template <class... S>
struct stage_list {
  static constexpr bool all_stages = detail::all_stages<S...>(std::index_sequence_for<S...>{});
  using input_type = stage_input_t<std::tuple_element_t<0, std::tuple<S..., torch::Tensor>>>;
  // The links are checked only once every element is a stage, so one mistake gives one error.
  using output_type = typename std::conditional_t<all_stages, detail::chain<0, input_type, S...>,
                                                  detail::no_chain>::output;
  static constexpr std::size_t size = sizeof...(S);

  std::tuple<S...> stages;

  /// The stages with their types erased, in order.
  std::vector<detail::StageSpec> specs() const {
    std::vector<detail::StageSpec> out;
    erase_all<0, input_type>(out);
    return out;
  }

 private:
  template <std::size_t I, class In>
  void erase_all(std::vector<detail::StageSpec>& out) const {
    if constexpr (I < sizeof...(S)) {
      using Stage = std::tuple_element_t<I, std::tuple<S...>>;
      out.push_back(detail::erase_stage<Stage, In>(std::get<I>(stages), I));
      erase_all<I + 1, stage_output_t<Stage, In>>(out);
    }
  }
};

template <>
struct stage_list<> {
  using input_type = torch::Tensor;
  using output_type = torch::Tensor;
  static constexpr std::size_t size = 0;
  std::tuple<> stages;
  std::vector<detail::StageSpec> specs() const { return {}; }
};

/// Makes a stage_list from stages, in pipeline order.
template <class... S>
stage_list<std::remove_cvref_t<S>...> stages(S&&... s) {
  return {std::tuple<std::remove_cvref_t<S>...>(std::forward<S>(s)...)};
}

}  // namespace stagewise
