#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <vector>

namespace stagewise::runtime {

/// Which processes exist and which stages each runs, as a pipe's transport knows them
/// (`pipe_transport`'s `processes()`): a pipe keeps the stages this process runs, and its saves
/// name every stage's process. One process: every stage here, on as many workers as the schedule
/// places them on (`stage` empty). Between processes: `stage[j]` is the process (job rank) of
/// stage j, and a schedule must place on one worker exactly the stages of one process.
///   stagewise::runtime::Processes p{.rank = 1, .count = 2, .stage = {0, 1, 1, 0}};  // V-shaped
///   p.runs(2);  // true: stage 2 is this process's
struct Processes {
  /// This process's rank in the job, and the job's number of processes.
  int rank = 0;
  int count = 1;
  /// The process of every stage; empty: every stage runs in this one.
  std::vector<int> stage = {};

  /// Whether stage `j` runs in this process.
  bool runs(std::size_t j) const { return stage.empty() || of(j) == rank; }
  /// The process that runs stage `j`.
  int of(std::size_t j) const {
    if (stage.empty()) return rank;
    TORCH_CHECK_INDEX(j < stage.size(), "stagewise::runtime::Processes: stage ", j,
                      " is out of range for ", stage.size(), " stages");
    return stage[j];
  }
};

}  // namespace stagewise::runtime
