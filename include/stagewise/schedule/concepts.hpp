#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

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

/// A schedule that also says where each stage runs: `s.worker_of(stage, stages)` names the
/// worker of `stage` (0 .. workers(stages)-1), for placements other than `k % workers`. The
/// V-shaped schedules put stages w and 2K-1-w on worker w, so a micro-batch goes down the
/// workers and back up, and the turn (stages K-1 and K) stays on one worker.
///   stagewise::schedule::zero_bubble_v{}.worker_of(5, 8)  // 2: worker 2 runs stages 2 and 5
template <class S>
concept placed_schedule = interleaved_schedule<S> && requires(const S& s, int stage, int stages) {
  { s.worker_of(stage, stages) } -> std::convertible_to<int>;
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

/// The worker of every stage under schedule `s`: `s.worker_of(k, stages)` for a placed schedule,
/// otherwise `k % workers_of(s, stages)` (one stage per worker, or interleaved).
///   stagewise::schedule::placement_of(stagewise::schedule::zero_bubble_v{}, 4)  // {0, 1, 1, 0}
template <pipeline_schedule S>
std::vector<int> placement_of(const S& s, int stages) {
  const int workers = workers_of(s, stages);
  std::vector<int> out(static_cast<std::size_t>(std::max(stages, 0)));
  for (int k = 0; k < stages; ++k) {
    if constexpr (placed_schedule<S>) {
      out[static_cast<std::size_t>(k)] = static_cast<int>(s.worker_of(k, stages));
    } else {
      out[static_cast<std::size_t>(k)] = workers > 0 ? k % workers : 0;
    }
  }
  return out;
}

/// A schedule that names itself: `S::name`, an identifier (`"one_f_one_b"`) that `choose`'s
/// report, `any_schedule(s)` and tools/schedule_svg print and look up, and optionally `S::title`,
/// the name its paper gives it (`"1F1B"`, for pictures). Every built-in does; a schedule of your
/// own may (docs/schedules.md, "A schedule of your own"). Also read where a schedule has them:
/// `s.stages_per_worker()` (stages to cut per worker, default 1) and
/// `s.min_micro_batches(workers)` (default 1).
///   struct my_schedule { static constexpr std::string_view name = "my_schedule"; ... };
///   static_assert(stagewise::schedule::named_schedule<my_schedule>);
template <class S>
concept named_schedule = pipeline_schedule<S> && requires {
  { S::name } -> std::convertible_to<std::string_view>;
};

/// The name of schedule `s`: `S::name`, followed by the stages per worker in braces where the
/// schedule takes them (`"interleaved_one_f_one_b{2}"`); a schedule with a `name()` (an
/// any_schedule) gives that.
///   stagewise::schedule::name_of(stagewise::schedule::looped_bfs{3})  // "looped_bfs{3}"
template <pipeline_schedule S>
requires named_schedule<S> || requires(const S& s) {
  std::string(s.name());
}
std::string name_of(const S& s) {
  if constexpr (named_schedule<S>) {
    std::string out(S::name);
    if constexpr (requires { s.virtual_stages; }) {
      out += "{" + std::to_string(s.virtual_stages) + "}";
    }
    return out;
  } else {
    return std::string(s.name());
  }
}

/// The name `s`'s paper gives it (`S::title`, e.g. "1F1B"), or `S::name` where it has none.
template <named_schedule S>
std::string title_of(const S&) {
  if constexpr (requires { S::title; }) {
    return std::string(std::string_view(S::title));
  } else {
    return std::string(std::string_view(S::name));
  }
}

/// How many stages `s` runs on each worker, so how many to cut the model into per worker:
/// `s.stages_per_worker()` where the schedule says (2 for the V-shaped ones, v for interleaved
/// and looped BFS), else 1.
template <pipeline_schedule S>
int stages_per_worker_of(const S& s) {
  if constexpr (requires { s.stages_per_worker(); }) {
    return static_cast<int>(s.stages_per_worker());
  } else {
    (void)s;
    return 1;
  }
}

/// The fewest micro-batches `s` runs on `workers` workers: `s.min_micro_batches(workers)` where
/// the schedule says (DualPipeV: 2 x workers), else 1.
template <pipeline_schedule S>
int min_micro_batches_of(const S& s, int workers) {
  if constexpr (requires { s.min_micro_batches(workers); }) {
    return static_cast<int>(s.min_micro_batches(workers));
  } else {
    (void)s;
    (void)workers;
    return 1;
  }
}

namespace detail {

// What is wrong with a placement of `stages` stages on `workers` workers, or "" when every
// stage names a worker in range and every worker runs at least one stage.
inline std::string placement_problem(const std::vector<int>& placement, int stages, int workers) {
  if (workers < 1 || workers > stages) {
    return "the schedule puts " + std::to_string(stages) + " stages on " + std::to_string(workers) +
           " workers; give each worker at least one stage (1 <= workers(stages) <= stages)";
  }
  if (static_cast<int>(placement.size()) != stages) {
    return "the placement names " + std::to_string(placement.size()) +
           " stages, the pipeline has " + std::to_string(stages);
  }
  std::vector<char> used(static_cast<std::size_t>(workers), 0);
  for (int k = 0; k < stages; ++k) {
    const int w = placement[static_cast<std::size_t>(k)];
    if (w < 0 || w >= workers) {
      return "worker_of(" + std::to_string(k) + ", " + std::to_string(stages) + ") is " +
             std::to_string(w) + ", outside the " + std::to_string(workers) +
             " workers; return 0.." + std::to_string(workers - 1);
    }
    used[static_cast<std::size_t>(w)] = 1;
  }
  for (int w = 0; w < workers; ++w) {
    if (!used[static_cast<std::size_t>(w)]) {
      return "worker " + std::to_string(w) +
             " runs no stage; make workers(stages) the number of "
             "workers that worker_of uses";
    }
  }
  return "";
}

}  // namespace detail

}  // namespace stagewise::schedule
