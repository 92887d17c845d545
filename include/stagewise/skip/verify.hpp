#pragma once

#include "stagewise/skip/namespace.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/skip/detail/type_list.hpp"

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

namespace stagewise {
namespace detail {

/// Where a layer sits in a typed pipe; shown in the compile-time skip diagnostics.
template <std::size_t Stage, std::size_t Layer>
struct stage_layer {
  static constexpr std::size_t stage = Stage;
  static constexpr std::size_t layer = Layer;
};

// The layers of a stage type: a stagewise::seq's layer types, or the stage itself.
template <class S>
struct stage_layer_types_of {
  using type = type_list<S>;
};
template <class S>
requires requires {
  typename S::layer_types;
}
struct stage_layer_types_of<S> {
  using type = typename S::layer_types;
};

template <std::size_t Stage, std::size_t Layer, class L>
struct layer_entry {
  using where = stage_layer<Stage, Layer>;
  using stashes = typename skip_declarations<L>::stash_list;
  using pops = typename skip_declarations<L>::pop_list;
};

template <std::size_t Stage, class Layers, class Seq = std::make_index_sequence<Layers::size>>
struct stage_entries;
template <std::size_t Stage, class... L, std::size_t... I>
struct stage_entries<Stage, type_list<L...>, std::index_sequence<I...>> {
  using type = type_list<layer_entry<Stage, I, L>...>;
};

template <class Stages, class Seq = std::make_index_sequence<Stages::size>>
struct pipe_entries;
template <class... S, std::size_t... J>
struct pipe_entries<type_list<S...>, std::index_sequence<J...>> {
  using type = concat_t<typename stage_entries<J, typename stage_layer_types_of<S>::type>::type...>;
};

// How often Skip is stashed / popped by the entries in [begin, end).
template <class Entries>
struct entry_counts;
template <class... E>
struct entry_counts<type_list<E...>> {
  template <class Skip>
  static constexpr std::size_t stashes(std::size_t begin, std::size_t end) {
    const std::array<std::size_t, sizeof...(E) + 1> c{count_of<typename E::stashes, Skip>..., 0};
    std::size_t n = 0;
    for (std::size_t k = begin; k < end && k < sizeof...(E); ++k) n += c[k];
    return n;
  }
  template <class Skip>
  static constexpr std::size_t pops(std::size_t begin, std::size_t end) {
    const std::array<std::size_t, sizeof...(E) + 1> c{count_of<typename E::pops, Skip>..., 0};
    std::size_t n = 0;
    for (std::size_t k = begin; k < end && k < sizeof...(E); ++k) n += c[k];
    return n;
  }
};

// The verdicts for skip X at entry K of Entries.
template <class Entries, std::size_t K, class X>
struct skip_verdict {
  using counts = entry_counts<Entries>;
  static constexpr std::size_t total = Entries::size;
  static constexpr bool same_layer = counts::template stashes<X>(K, K + 1) > 0 &&
                                     counts::template pops<X>(K, K + 1) > 0;
  static constexpr std::size_t stashed_before = counts::template stashes<X>(0, K);
  static constexpr std::size_t popped_before = counts::template pops<X>(0, K);
  static constexpr bool pop_has_stash = same_layer || stashed_before > 0;
  static constexpr bool pop_is_first =
      same_layer || (popped_before == 0 && counts::template pops<X>(K, K + 1) == 1);
  static constexpr bool stash_is_first =
      same_layer || (stashed_before == 0 && counts::template stashes<X>(K, K + 1) == 1);
  static constexpr bool stash_has_pop = same_layer || stashed_before > 0 ||
                                        counts::template pops<X>(K + 1, total) > 0;
};

// One diagnostic per kind of mistake; the template arguments carry where and which skip, so the
// compiler prints them in the "In instantiation of ..." line above the message.
template <bool Ok, class Where, class Skip>
struct pop_without_stash {
  static_assert(Ok,
                "stagewise::Pipe: a layer pops a skip that no earlier layer stashes (stage, "
                "layer, namespace and name are in 'pop_without_stash<false, "
                "stage_layer<Stage, Layer>, skip<Namespace, Name>>' above). Add "
                "stagewise::stashes<...> with this skip to the earlier layer that produces the "
                "tensor, or remove the pop.");
};
template <bool Ok, class Where, class Skip>
struct stashed_twice {
  static_assert(Ok,
                "stagewise::Pipe: a skip is stashed twice in one namespace (the second stash's "
                "stage, layer, namespace and name are in 'stashed_twice<false, "
                "stage_layer<Stage, Layer>, skip<Namespace, Name>>' above). Give each stash its "
                "own namespace (e.g. Down<Encoder2> for the second block) or its own name.");
};
template <bool Ok, class Where, class Skip>
struct popped_twice {
  static_assert(Ok,
                "stagewise::Pipe: a skip is popped twice in one namespace (the second pop's "
                "stage, layer, namespace and name are in 'popped_twice<false, "
                "stage_layer<Stage, Layer>, skip<Namespace, Name>>' above). Each stash is popped "
                "exactly once: pop it in one layer only, or stash it again under another "
                "namespace or name.");
};
template <bool Ok, class Where, class Skip>
struct stash_and_pop_in_one_layer {
  static_assert(Ok,
                "stagewise::Pipe: a layer stashes and pops the same skip (stage, layer, "
                "namespace and name are in 'stash_and_pop_in_one_layer<false, "
                "stage_layer<Stage, Layer>, skip<Namespace, Name>>' above). Keep the tensor in a "
                "local variable inside the layer instead, or split the layer in two.");
};
template <bool Ok, class Where, class Skip>
struct stash_without_pop {
  static_assert(Ok,
                "stagewise::Pipe: a skip is stashed but no later layer pops it (stage, layer, "
                "namespace and name are in 'stash_without_pop<false, stage_layer<Stage, Layer>, "
                "skip<Namespace, Name>>' above). Add stagewise::pops<...> with this skip to the "
                "later layer that consumes the tensor, or remove the stash.");
};

template <class Entries, std::size_t K, class X>
constexpr std::size_t check_pop() {
  using v = skip_verdict<Entries, K, X>;
  using where = typename at_t<K, Entries>::where;
  return sizeof(stash_and_pop_in_one_layer<!v::same_layer, where, X>) +
         sizeof(pop_without_stash<v::pop_has_stash, where, X>) +
         sizeof(popped_twice<v::pop_is_first, where, X>);
}
template <class Entries, std::size_t K, class X>
constexpr std::size_t check_stash() {
  using v = skip_verdict<Entries, K, X>;
  using where = typename at_t<K, Entries>::where;
  return sizeof(stashed_twice<v::stash_is_first, where, X>) +
         sizeof(stash_without_pop<v::stash_has_pop, where, X>);
}

template <class Entries, std::size_t K, class Stashes, class Pops>
struct entry_checks;
template <class Entries, std::size_t K, class... St, class... Po>
struct entry_checks<Entries, K, type_list<St...>, type_list<Po...>> {
  static constexpr std::size_t value = (std::size_t{0} + ... + check_stash<Entries, K, St>()) +
                                       (std::size_t{0} + ... + check_pop<Entries, K, Po>());
  static constexpr bool ok =
      (true && ... &&
       (skip_verdict<Entries, K, St>::stash_is_first &&
        skip_verdict<Entries, K, St>::stash_has_pop)) &&
      (true && ... &&
       (!skip_verdict<Entries, K, Po>::same_layer && skip_verdict<Entries, K, Po>::pop_has_stash &&
        skip_verdict<Entries, K, Po>::pop_is_first));
};

template <class Entries, class Seq = std::make_index_sequence<Entries::size>>
struct all_checks;
template <class Entries, std::size_t... K>
struct all_checks<Entries, std::index_sequence<K...>> {
  template <std::size_t I>
  using checks =
      entry_checks<Entries, I, typename at_t<I, Entries>::stashes, typename at_t<I, Entries>::pops>;
  static constexpr bool ok = (true && ... && checks<K>::ok);
  // Instantiates every diagnostic; the failing ones report themselves.
  static constexpr std::size_t instantiate() { return (std::size_t{0} + ... + checks<K>::value); }
};

template <class... Stages>
using skip_entries_t = typename pipe_entries<type_list<Stages...>>::type;

/// Always true; evaluating it reports every stash/pop mistake of the stage list as its own
/// compile error. `Pipe<Stages...>` static_asserts it.
template <class... Stages>
inline constexpr bool skips_checked = all_checks<skip_entries_t<Stages...>>::instantiate() > 0 ||
                                      true;

}  // namespace detail

/// True when the stashes and pops declared by the typed stages (and by the layers of their
/// `seq`s) pair up: every pop has exactly one earlier stash in the same namespace, nothing is
/// stashed or popped twice, no layer stashes and pops one skip, and every stash is popped.
///   static_assert(stagewise::skips_match<Down, Up>);
template <class... Stages>
inline constexpr bool skips_match = detail::all_checks<detail::skip_entries_t<Stages...>>::ok;

}  // namespace stagewise
