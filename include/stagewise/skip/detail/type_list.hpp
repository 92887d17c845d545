#pragma once

#include <cstddef>
#include <type_traits>

namespace stagewise::detail {

// A minimal mp11-style type list for the compile-time skip checks.
template <class... T>
struct type_list {
  static constexpr std::size_t size = sizeof...(T);
};

// How many times T occurs in List.
template <class List, class T>
inline constexpr std::size_t count_of = 0;
template <class... U, class T>
inline constexpr std::size_t count_of<type_list<U...>, T> = (std::size_t{0} + ... +
                                                             (std::is_same_v<U, T> ? 1 : 0));

// Concatenation of type lists.
template <class... Lists>
struct concat {
  using type = type_list<>;
};
template <class... A>
struct concat<type_list<A...>> {
  using type = type_list<A...>;
};
template <class... A, class... B, class... Rest>
struct concat<type_list<A...>, type_list<B...>, Rest...> {
  using type = typename concat<type_list<A..., B...>, Rest...>::type;
};
template <class... Lists>
using concat_t = typename concat<Lists...>::type;

// The elements of List that are not in Other (order kept).
template <class List, class Other>
struct subtract;
template <class... A, class Other>
struct subtract<type_list<A...>, Other> {
  using type = concat_t<std::conditional_t<count_of<Other, A> == 0, type_list<A>, type_list<>>...>;
};
template <class List, class Other>
using subtract_t = typename subtract<List, Other>::type;

// List without repeated elements (first occurrences kept).
template <class List, class Seen = type_list<>>
struct unique {
  using type = Seen;
};
template <class First, class... Rest, class... Seen>
struct unique<type_list<First, Rest...>, type_list<Seen...>> {
  using type =
      typename unique<type_list<Rest...>,
                      std::conditional_t<count_of<type_list<Seen...>, First> == 0,
                                         type_list<Seen..., First>, type_list<Seen...>>>::type;
};
template <class List>
using unique_t = typename unique<List>::type;

// Element I of a list.
template <std::size_t I, class List>
struct type_at;
template <std::size_t I, class First, class... Rest>
struct type_at<I, type_list<First, Rest...>> : type_at<I - 1, type_list<Rest...>> {};
template <class First, class... Rest>
struct type_at<0, type_list<First, Rest...>> {
  using type = First;
};
template <std::size_t I, class List>
using at_t = typename type_at<I, List>::type;

}  // namespace stagewise::detail
