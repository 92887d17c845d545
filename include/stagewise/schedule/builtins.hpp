#pragma once

#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/v_min.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include <c10/util/Exception.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace stagewise::schedule {

/// A list of schedule types, for `for_each_schedule`.
template <named_schedule... S>
struct schedule_list {};

/// The built-in schedules, the one list every tool iterates: `choose`'s default candidates (those
/// without `default_candidate = false`, in this order: ties go to the earlier one),
/// `builtin_schedule`'s names and tools/schedule_svg. Each names itself (`named_schedule`).
/// Adding a schedule: its header, its line here, its test.
using builtin_schedules = schedule_list<gpipe, one_f_one_b, zero_bubble_h1, interleaved_one_f_one_b,
                                        looped_bfs, zero_bubble_v, dualpipe_v, v_half, v_min>;

/// Calls `f(S{})` for each schedule S of `List` (default: the built-ins), in order.
///   stagewise::schedule::for_each_schedule([](auto s) { std::cout << s.name << "\n"; });
template <class List = builtin_schedules, class F>
void for_each_schedule(F&& f) {
  [&]<class... S>(schedule_list<S...>) { (f(S{}), ...); }(List{});
}

/// Whether `choose` weighs `s` by default: `S::default_candidate` where the schedule says, else
/// true.
template <named_schedule S>
constexpr bool default_candidate(const S&) {
  if constexpr (requires { S::default_candidate; }) {
    return S::default_candidate;
  } else {
    return true;
  }
}

/// The names of the built-in schedules (`S::name`), in the list's order.
inline std::vector<std::string> builtin_names() {
  std::vector<std::string> out;
  for_each_schedule([&](auto s) { out.emplace_back(s.name); });
  return out;
}

/// The built-in schedule named `name` (`S::name`: "one_f_one_b", "v_min", ...) as an
/// any_schedule, with `virtual_stages` for those that take them (interleaved_one_f_one_b,
/// looped_bfs); fails naming the built-ins when none is. For a program that picks its schedule
/// from a flag.
///   pipe->train_step(x, y, loss_fn, stagewise::schedule::builtin_schedule(flags.schedule));
inline any_schedule builtin_schedule(std::string_view name, int virtual_stages = 2) {
  std::vector<any_schedule> found;
  for_each_schedule([&](auto s) {
    if (s.name != name) return;
    if constexpr (requires { s.virtual_stages; }) s.virtual_stages = virtual_stages;
    found.emplace_back(s);
  });
  if (found.empty()) {
    std::string names;
    for (const auto& n : builtin_names()) names += (names.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "stagewise::schedule::builtin_schedule: no built-in schedule is named '",
                name, "'; the built-ins are ", names);
  }
  return std::move(found.front());
}

}  // namespace stagewise::schedule
