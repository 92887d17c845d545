#pragma once

#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/plan.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

namespace stagewise::schedule {

namespace detail {

// Whether two schedules of type S make the same actions: by their ==, or, for a schedule without
// one, by its value's bytes (an empty schedule, or one of plain fields such as
// interleaved_one_f_one_b's virtual_stages). Other schedules (a plain function among them) are
// not comparable: never cached.
template <class S>
constexpr bool cacheable_schedule =
    std::is_object_v<S> && (std::equality_comparable<S> || std::is_empty_v<S> ||
                            std::has_unique_object_representations_v<S>);

template <class S>
bool same_schedule(const void* a, const void* b) {
  const auto& x = *static_cast<const S*>(a);
  const auto& y = *static_cast<const S*>(b);
  if constexpr (std::equality_comparable<S>) {
    return x == y;
  } else if constexpr (std::is_empty_v<S>) {
    return true;
  } else {
    return std::memcmp(&x, &y, sizeof(S)) == 0;
  }
}

}  // namespace detail

/// Plans made once and reused: `get` returns the plan of a schedule (verified and laid out by
/// `plan`, and, given offload costs, rewritten by the `offload` pass) made on its first call
/// with those arguments, and the same plan on every later call with equal ones: the schedule
/// (equal by its `==`, or by value for a schedule of plain fields), the numbers of stages and
/// micro-batches, the checkpointed counts and the offload costs. A pipe keeps one, so a step
/// plans only when one of them changed (e.g. a last, smaller batch that splits into fewer
/// micro-batches); at most `capacity` plans are kept (the least recently used goes first). A
/// schedule whose equality cannot be told (a type holding pointers or strings without `==`) is
/// planned on every call.
///   stagewise::schedule::PlanCache plans;
///   auto p = plans.get(stagewise::schedule::one_f_one_b{}, 64, 512, std::vector<int>(64, 0));
///   auto q = plans.get(stagewise::schedule::one_f_one_b{}, 64, 512, std::vector<int>(64, 0));
///   p == q;  // the same plan, made once
class PlanCache {
 public:
  explicit PlanCache(std::size_t capacity = 8) : capacity_(capacity < 1 ? 1 : capacity) {}

  /// The plan of `sched` for `stages` stages and `micro_batches` micro-batches with the first
  /// `checkpointed[k]` micro-batches of stage k checkpointed, with offloads placed by
  /// `offload(plan, *costs)` when `costs` is given; made once (see the class comment).
  template <pipeline_schedule S>
  std::shared_ptr<const Plan> get(const S& sched, int stages, int micro_batches,
                                  const std::vector<int>& checkpointed,
                                  const OffloadCosts* costs = nullptr) {
    std::optional<OffloadCosts> offload;
    if (costs != nullptr) offload = *costs;
    if constexpr (detail::cacheable_schedule<S>) {
      for (std::size_t k = 0; k < entries_.size(); ++k) {
        const Entry& e = entries_[k];
        if (e.type == std::type_index(typeid(S)) && e.stages == stages &&
            e.micro_batches == micro_batches && e.checkpointed == checkpointed &&
            e.offload == offload && e.same(e.schedule.get(), &sched)) {
          ++hits_;
          std::rotate(entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(k),
                      entries_.begin() + static_cast<std::ptrdiff_t>(k) + 1);
          return entries_.front().plan;
        }
      }
    }
    ++misses_;
    Plan p = plan(sched, stages, micro_batches, checkpointed);
    if (offload) p = schedule::offload(p, *offload);
    auto made = std::make_shared<const Plan>(std::move(p));
    if constexpr (detail::cacheable_schedule<S>) {
      if (entries_.size() == capacity_) entries_.pop_back();
      entries_.insert(entries_.begin(), Entry{std::type_index(typeid(S)),
                                              std::make_shared<const S>(sched),
                                              &detail::same_schedule<S>, stages, micro_batches,
                                              checkpointed, std::move(offload), made});
    }
    return made;
  }

  /// Calls answered from the cache, and calls that planned.
  std::int64_t hits() const { return hits_; }
  std::int64_t misses() const { return misses_; }
  /// Plans kept now.
  std::size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::type_index type;
    std::shared_ptr<const void> schedule;
    bool (*same)(const void*, const void*);
    int stages;
    int micro_batches;
    std::vector<int> checkpointed;
    std::optional<OffloadCosts> offload;
    std::shared_ptr<const Plan> plan;
  };
  std::size_t capacity_;
  std::vector<Entry> entries_;  // most recently used first
  std::int64_t hits_ = 0;
  std::int64_t misses_ = 0;
};

}  // namespace stagewise::schedule
