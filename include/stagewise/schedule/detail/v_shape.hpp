#pragma once

// The V placement shared by the V-shaped schedules (zero_bubble_v, dualpipe_v): 2K stages on K
// workers, worker w running stages w and 2K-1-w.

#include <c10/util/Exception.h>

#include <string_view>

namespace stagewise::schedule::detail {

/// The number of workers for `stages` stages in a V: stages / 2. `name` is the schedule's name
/// ("zero_bubble_v"), `title` its paper's ("ZB-V"), for the error.
inline int v_workers(int stages, std::string_view name, std::string_view title) {
  TORCH_CHECK(stages >= 2 && stages % 2 == 0, "stagewise::schedule::", name, ": ", stages,
              " stages do not make a V; ", title,
              " places 2 stages on each worker, give the pipe an even number of stages (e.g. "
              "sw::even_balance(n, 2 * workers))");
  return stages / 2;
}

/// The worker of `stage` in a V of `workers` workers.
inline int v_worker_of(int stage, int workers) {
  return stage < workers ? stage : 2 * workers - 1 - stage;
}

}  // namespace stagewise::schedule::detail
