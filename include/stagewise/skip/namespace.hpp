#pragma once

#include <c10/util/Type.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>

namespace stagewise {

/// A string literal usable as a template argument: the name in `skip<Ns, "x">`.
///   stagewise::fixed_string name = "x";  // name.view() == "x"
template <std::size_t N>
struct fixed_string {
  char data[N]{};
  constexpr fixed_string(const char (&text)[N]) { std::copy_n(text, N, data); }  // NOLINT(implicit)
  constexpr std::string_view view() const { return {data, N - 1}; }
};

/// A skip namespace: any class type, used only as a tag. Equal skip names in different namespaces
/// are different skips, so one block type can be reused once per namespace (a U-Net's levels).
///   struct Encoder1 {};  static_assert(stagewise::skip_namespace<Encoder1>);
template <class T>
concept skip_namespace = std::is_class_v<T>;

/// A skip connection named by a string: namespace `Ns`, name `Name`.
///   struct Encoder1 {};
///   using skip_x = stagewise::skip<Encoder1, "x">;
template <skip_namespace Ns, fixed_string Name>
struct skip {
  using namespace_type = Ns;
  static constexpr std::string_view name() { return Name.view(); }
};

/// A skip connection named by a tag type instead of a string.
///   struct Encoder1 {};  struct features {};
///   using skip_f = stagewise::tagged_skip<Encoder1, features>;
template <skip_namespace Ns, class Tag>
struct tagged_skip {
  using namespace_type = Ns;
  using tag_type = Tag;
};

namespace detail {
template <class T>
struct is_skip : std::false_type {};
template <class Ns, fixed_string Name>
struct is_skip<skip<Ns, Name>> : std::true_type {};
template <class Ns, class Tag>
struct is_skip<tagged_skip<Ns, Tag>> : std::true_type {};
}  // namespace detail

/// A skip connection type: `skip<Ns, "name">` or `tagged_skip<Ns, Tag>`.
///   static_assert(stagewise::skip_type<stagewise::skip<Encoder1, "x">>);
template <class S>
concept skip_type = detail::is_skip<S>::value;

/// What the run time knows about a skip: its namespace and name, for messages. Each skip type has
/// exactly one (`skip_info_of<S>`), so its address identifies the skip.
struct SkipInfo {
  std::string (*namespace_name)();
  std::string (*name)();

  /// "'x' in namespace Encoder1"
  std::string describe() const { return "'" + name() + "' in namespace " + namespace_name(); }
};

namespace detail {
template <class T>
std::string type_name() {
  return c10::demangle(typeid(T).name());
}
template <class S>
std::string skip_name() {
  if constexpr (requires { S::name(); }) {
    return std::string(S::name());
  } else {
    return type_name<typename S::tag_type>();
  }
}
}  // namespace detail

/// The one SkipInfo of skip type `S`; `&skip_info_of<S>` is the skip's identity at run time.
template <skip_type S>
inline constexpr SkipInfo skip_info_of{&detail::type_name<typename S::namespace_type>,
                                       &detail::skip_name<S>};

}  // namespace stagewise
