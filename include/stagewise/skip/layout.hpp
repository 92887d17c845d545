#pragma once

#include "stagewise/schedule/comms.hpp"
#include "stagewise/skip/detail/type_list.hpp"
#include "stagewise/skip/namespace.hpp"
#include "stagewise/skip/tracker.hpp"
#include "stagewise/skip/verify.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

namespace stagewise {

/// One skip's route through a pipe: the schedule layer's `SkipRoute` (the stage that stashes it
/// and the stage that pops it, `none` for a side nobody declares) and the skip it routes. A skip
/// within one stage needs no copy; one that crosses stages travels through a portal from
/// `stash_stage` straight to `pop_stage`.
///   stagewise::skip_route{0, 2, &stagewise::skip_info_of<MySkip>}
struct skip_route : schedule::SkipRoute {
  const SkipInfo* skip = nullptr;
  friend constexpr bool operator==(const skip_route&, const skip_route&) = default;
};

namespace detail {
// Insertion sort by stash stage; stable, so routes from one stage keep their stash order.
template <std::size_t N>
constexpr void sort_by_source(std::array<skip_route, N>& routes) {
  for (std::size_t i = 1; i < N; ++i) {
    for (std::size_t k = i; k > 0 && routes[k].stash_stage < routes[k - 1].stash_stage; --k) {
      std::swap(routes[k], routes[k - 1]);
    }
  }
}

template <class Entries, class X, class Seq = std::make_index_sequence<Entries::size>>
struct route_of;
template <class Entries, class X, std::size_t... K>
struct route_of<Entries, X, std::index_sequence<K...>> {
  static constexpr skip_route value() {
    skip_route r;
    r.skip = &skip_info_of<X>;
    const std::array<std::size_t, sizeof...(K) + 1> stage{at_t<K, Entries>::where::stage..., 0};
    const std::array<bool, sizeof...(K) + 1> stashes{
        (count_of<typename at_t<K, Entries>::stashes, X> > 0)..., false};
    const std::array<bool, sizeof...(K) + 1> pops{
        (count_of<typename at_t<K, Entries>::pops, X> > 0)..., false};
    for (std::size_t k = 0; k < sizeof...(K); ++k) {
      const int at = static_cast<int>(stage[k]);
      if (stashes[k] && r.stash_stage == skip_route::none) r.stash_stage = at;
      if (pops[k] && r.pop_stage == skip_route::none) r.pop_stage = at;
    }
    return r;
  }
};

template <class Entries>
struct stashed_skips;
template <class... E>
struct stashed_skips<type_list<E...>> {
  using type = unique_t<concat_t<typename E::stashes...>>;
};
}  // namespace detail

/// The skip layout of a typed stage list, computed at compile time: which stage stashes and which
/// pops each skip, and the copies each stage receives. `Pipe<S...>::skip_layout_type` is this.
///   using L = stagewise::skip_layout<StageA, StageB, StageC>;
///   static_assert(L::route<skip_x>().stash_stage == 0);
///   static_assert(L::copies_into<2>().size() == 1);
template <class... Stages>
struct skip_layout {
  using entries = detail::skip_entries_t<Stages...>;
  /// Every stashed skip, in stash order.
  using skips = typename detail::stashed_skips<entries>::type;
  static constexpr std::size_t num_stages = sizeof...(Stages);

  /// The route of skip `S` (`skip_route::none` for a side nobody declares).
  template <skip_type S>
  static constexpr skip_route route() {
    return detail::route_of<entries, S>::value();
  }

  /// Every route, in stash order.
  static constexpr auto routes() { return routes_of(skips{}); }

  /// The cross-stage routes that end at stage `J`, sorted by stashing stage.
  template <std::size_t J>
  static constexpr auto copies_into() {
    std::array<skip_route, count_into(J)> out{};
    std::size_t k = 0;
    for (const auto& r : routes()) {
      if (r.pop_stage == static_cast<int>(J) && r.requires_copy()) out[k++] = r;
    }
    detail::sort_by_source(out);
    return out;
  }

  /// Number of skips that cross stages (each needs a portal).
  static constexpr std::size_t num_copies() {
    std::size_t c = 0;
    for (const auto& r : routes()) c += r.requires_copy() ? 1 : 0;
    return c;
  }

 private:
  static constexpr std::size_t count_into(std::size_t j) {
    std::size_t c = 0;
    for (const auto& r : routes()) {
      c += (r.pop_stage == static_cast<int>(j) && r.requires_copy()) ? 1 : 0;
    }
    return c;
  }
  template <class... X>
  static constexpr std::array<skip_route, sizeof...(X)> routes_of(detail::type_list<X...>) {
    return {route<X>()...};
  }
};

namespace detail {

/// A pipe's skip layout at run time: the routes, and what each stage stashes and pops.
class SkipLayout {
 public:
  SkipLayout() = default;
  SkipLayout(std::size_t num_stages, std::vector<skip_route> routes)
      : routes_(std::move(routes)), stages_(num_stages), into_(num_stages), from_(num_stages) {
    const auto inside = [&](int j) { return j >= 0 && static_cast<std::size_t>(j) < num_stages; };
    for (const auto& r : routes_) {
      TORCH_CHECK(inside(r.stash_stage) && inside(r.pop_stage) && r.skip != nullptr,
                  "stagewise: internal error: a skip route outside the pipe's stages");
      stage_routes_.push_back(r);
      stages_[r.stash_stage].stashes.push_back(r.skip);
      stages_[r.pop_stage].pops.push_back(r.skip);
      if (!r.requires_copy()) continue;
      crosses_ = true;
      into_[r.pop_stage].push_back(r);
      from_[r.stash_stage].push_back(r);
    }
    for (auto& into : into_) {
      std::stable_sort(into.begin(), into.end(), [](const skip_route& a, const skip_route& b) {
        return a.stash_stage < b.stash_stage;
      });
    }
  }

  bool empty() const { return routes_.empty(); }
  /// True when some skip crosses stages (portals are needed).
  bool has_copies() const { return crosses_; }
  std::size_t num_stages() const { return stages_.size(); }
  const std::vector<skip_route>& routes() const { return routes_; }
  /// The same routes without their skips, in the same order: what `schedule::comms` and the
  /// transports take (skip i's messages carry index i).
  const std::vector<schedule::SkipRoute>& stage_routes() const { return stage_routes_; }

  /// The route of `skip`, or null when the pipe does not route it.
  const skip_route* find(const SkipInfo& skip) const {
    for (const auto& r : routes_) {
      if (r.skip == &skip) return &r;
    }
    return nullptr;
  }
  /// The index of `skip` in `routes()` (the skip index of skip messages).
  std::size_t index_of(const SkipInfo& skip) const {
    const auto* r = find(skip);
    TORCH_CHECK(r != nullptr, "stagewise: skip ", skip.describe(),
                " is not routed by this pipe; declare it in a stage of the pipe");
    return static_cast<std::size_t>(r - routes_.data());
  }
  bool requires_copy(const SkipInfo& skip) const {
    const auto* r = find(skip);
    return r != nullptr && r->requires_copy();
  }

  /// The cross-stage routes ending at stage `j`, sorted by stashing stage (torchgpipe's copy
  /// policy: each is copied straight from its source stage).
  const std::vector<skip_route>& copies_into(std::size_t j) const { return into_.at(j); }
  /// The cross-stage routes that start at stage `j`.
  const std::vector<skip_route>& copies_from(std::size_t j) const { return from_.at(j); }

  /// Everything stage `j` stashes and pops: checked while the stage runs.
  const SkipDeclarations& stage(std::size_t j) const { return stages_.at(j); }

 private:
  std::vector<skip_route> routes_;
  std::vector<schedule::SkipRoute> stage_routes_;
  std::vector<SkipDeclarations> stages_;
  std::vector<std::vector<skip_route>> into_;  // by popping stage, sorted by source
  std::vector<std::vector<skip_route>> from_;  // by stashing stage
  bool crosses_ = false;
};

}  // namespace detail
}  // namespace stagewise
