#pragma once

#include "stagewise/skip/namespace.hpp"
#include "stagewise/skip/tracker.hpp"
#include "stagewise/skip/detail/type_list.hpp"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise {

/// The skips a layer stashes, as a type: `stashes<skip_a, skip_b>`.
template <skip_type... S>
struct stashes {
  using list = detail::type_list<S...>;
};

/// The skips a layer pops, as a type: `pops<skip_a>`.
template <skip_type... S>
struct pops {
  using list = detail::type_list<S...>;
};

namespace detail {
template <class T>
struct declaration_kind {
  static constexpr int value = 0;
};
template <class... S>
struct declaration_kind<stashes<S...>> {
  static constexpr int value = 1;
};
template <class... S>
struct declaration_kind<pops<S...>> {
  static constexpr int value = 2;
};

template <int Kind, class D>
using list_if =
    std::conditional_t<declaration_kind<D>::value == Kind, typename D::list, type_list<>>;

template <class L>
struct infos_of;
template <class... S>
struct infos_of<type_list<S...>> {
  static const std::vector<const SkipInfo*>& get() {
    static const std::vector<const SkipInfo*> infos{&skip_info_of<S>...};
    return infos;
  }
};

// The run-time face of every Skippable layer: what it declares, found by dynamic_cast when a pipe
// walks its stages' modules.
class SkippableBase {
 public:
  virtual ~SkippableBase() = default;
  virtual const SkipDeclarations& declared_skips() const = 0;
};

// Runs `body` (a call of `layer`) with the layer's declarations checked at run time when the
// layer is Skippable; otherwise just runs it.
template <class F>
decltype(auto) in_layer_frame(const torch::nn::Module& layer, F&& body) {
  const auto* skippable = dynamic_cast<const SkippableBase*>(&layer);
  if (skippable == nullptr) return std::forward<F>(body)();
  LayerFrame frame(skippable->declared_skips(), [&layer] { return layer.name(); });
  decltype(auto) out = std::forward<F>(body)();
  frame.finish();
  return out;
}

template <bool Declared, class Layer, class Skip>
struct stash_not_declared {
  static_assert(
      Declared,
      "stagewise::stash: this layer stashes a skip it does not declare (the layer and the "
      "skip are the last two arguments of 'stash_not_declared<false, Layer, Skip>' "
      "above). Add the skip to the layer's stagewise::stashes<...>.");
};
template <bool Declared, class Layer, class Skip>
struct pop_not_declared {
  static_assert(Declared,
                "stagewise::pop: this layer pops a skip it does not declare (the layer and the "
                "skip are the last two arguments of 'pop_not_declared<false, Layer, Skip>' "
                "above). Add the skip to the layer's stagewise::pops<...>.");
};
}  // namespace detail

/// A list of skips as a type, e.g. for a `skip_declarations` specialization.
template <skip_type... S>
using skip_list = detail::type_list<S...>;

/// A declaration for `Skippable`: `stashes<...>` or `pops<...>`.
template <class D>
concept skip_declaration = detail::declaration_kind<D>::value != 0;

/// Base class of a layer that stashes or pops skips: a torch::nn::Module whose declarations are
/// types, so a `Pipe` over typed stages checks the stash/pop pairing at compile time.
///
/// Inside `forward`, call the member `stash<S>(tensor)` / `pop<S>()`; using a skip the layer does
/// not declare does not compile. In a class template (a block reused under several namespaces)
/// write `stagewise::stash<S>(this, tensor)` / `stagewise::pop<S>(this)`, which check the same.
///   struct Encoder1 {};
///   using skip_x = stagewise::skip<Encoder1, "x">;
///   struct DownImpl : stagewise::Skippable<DownImpl, stagewise::stashes<skip_x>> {
///     torch::Tensor forward(torch::Tensor x) { stash<skip_x>(x); return x * 2; }
///   };
///   TORCH_MODULE(Down);
template <class Derived, skip_declaration... Declarations>
class Skippable : public torch::nn::Module, public detail::SkippableBase {
 public:
  /// The skips this layer stashes and pops, in declaration order.
  using stash_list = detail::concat_t<detail::list_if<1, Declarations>...>;
  using pop_list = detail::concat_t<detail::list_if<2, Declarations>...>;

  Skippable() = default;
  explicit Skippable(std::string name) : torch::nn::Module(std::move(name)) {}

  const detail::SkipDeclarations& declared_skips() const override {
    static const detail::SkipDeclarations declared{detail::infos_of<stash_list>::get(),
                                                   detail::infos_of<pop_list>::get()};
    return declared;
  }

 protected:
  /// Stashes `tensor` under `S`, which this layer must declare in `stashes<...>`.
  template <skip_type S>
  void stash(torch::Tensor tensor) {
    (void)detail::stash_not_declared<(detail::count_of<stash_list, S> > 0), Derived, S>{};
    detail::stash_now(skip_info_of<S>, std::move(tensor));
  }
  /// Pops the tensor of `S`, which this layer must declare in `pops<...>`.
  template <skip_type S>
  torch::Tensor pop() {
    (void)detail::pop_not_declared<(detail::count_of<pop_list, S> > 0), Derived, S>{};
    return detail::pop_now(skip_info_of<S>);
  }
};

/// What a layer type stashes and pops, as type lists (`stash_list`, `pop_list`): a `Skippable`'s
/// declarations, looked up through module holders. Specialize it for a composite module whose
/// children stash or pop, so typed pipes see its skips at compile time.
///   template <> struct stagewise::skip_declarations<MyBlockImpl> {
///     using stash_list = stagewise::skip_list<skip_x>;
///     using pop_list = stagewise::skip_list<>;
///   };
template <class T>
struct skip_declarations {
  using stash_list = detail::type_list<>;
  using pop_list = detail::type_list<>;
};
template <class T>
requires requires {
  typename T::stash_list;
  typename T::pop_list;
}
struct skip_declarations<T> {
  using stash_list = typename T::stash_list;
  using pop_list = typename T::pop_list;
};
template <class T>
requires std::is_base_of_v<torch::nn::ModuleHolder<typename T::ContainedType>, T>
struct skip_declarations<T> : skip_declarations<typename T::ContainedType> {
};

/// A layer type that declares skips (through `Skippable` or a `skip_declarations`
/// specialization).
template <class T>
concept skippable = skip_declarations<std::remove_cvref_t<T>>::stash_list::size +
                        skip_declarations<std::remove_cvref_t<T>>::pop_list::size >
                    0;

/// Stashes `tensor` under `S` from layer `self`, checking at compile time that the layer declares
/// `S` in `stashes<...>` (the form for class templates, where the member is not found by name).
///   stagewise::stash<stagewise::skip<Ns, "x">>(this, x);
template <skip_type S, class Layer>
void stash(Layer* self, torch::Tensor tensor) {
  (void)self;
  using declared = typename skip_declarations<std::remove_cv_t<Layer>>::stash_list;
  (void)
      detail::stash_not_declared<(detail::count_of<declared, S> > 0), std::remove_cv_t<Layer>, S>{};
  detail::stash_now(skip_info_of<S>, std::move(tensor));
}

/// Pops `S` from layer `self`, checking at compile time that the layer declares `S` in
/// `pops<...>`.
///   auto x = stagewise::pop<stagewise::skip<Ns, "x">>(this);
template <skip_type S, class Layer>
torch::Tensor pop(Layer* self) {
  (void)self;
  using declared = typename skip_declarations<std::remove_cv_t<Layer>>::pop_list;
  (void)detail::pop_not_declared<(detail::count_of<declared, S> > 0), std::remove_cv_t<Layer>, S>{};
  return detail::pop_now(skip_info_of<S>);
}

}  // namespace stagewise
