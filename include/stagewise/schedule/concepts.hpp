#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"

#include <concepts>

namespace stagewise::schedule {

/// A pipeline schedule: a callable that, for `stages` stages and `micro_batches` micro-batches,
/// returns a coroutine yielding every action of a training step. The actions of one worker are
/// performed in the order they are yielded; actions of different workers may come in any
/// interleaving (a schedule usually yields stage 0's actions, then stage 1's, ...).
///   struct my_schedule {
///     stagewise::coro::generator<Action> operator()(int stages, int micro_batches) const;
///   };
///   static_assert(stagewise::schedule::pipeline_schedule<my_schedule>);
template <class S>
concept pipeline_schedule = requires(const S& s, int stages, int micro_batches) {
  { s(stages, micro_batches) } -> std::same_as<coro::generator<Action>>;
};

/// A schedule that runs several stages on one worker: `s.workers(stages)` says how many workers
/// share the stages, and stage `k` runs on worker `k % workers` (so worker w holds the virtual
/// stages w, w + K, w + 2K, ...). A schedule without `workers` runs one stage per worker.
///   stagewise::schedule::interleaved_one_f_one_b{2}.workers(8)  // 4
template <class S>
concept interleaved_schedule = pipeline_schedule<S> && requires(const S& s, int stages) {
  { s.workers(stages) } -> std::convertible_to<int>;
};

/// How many workers run `stages` stages under schedule `s`: `s.workers(stages)` for an
/// interleaved schedule, otherwise one per stage.
template <pipeline_schedule S>
int workers_of(const S& s, int stages) {
  if constexpr (interleaved_schedule<S>) {
    return static_cast<int>(s.workers(stages));
  } else {
    (void)s;
    return stages;
  }
}

}  // namespace stagewise::schedule
