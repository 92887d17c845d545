#pragma once

// CPU clocks and core pinning for benchmarks that define overhead in CPU time.

#include "benchmarks/common/files.hpp"

#include <sched.h>
#include <sys/types.h>
#include <time.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::bench {

/// CPU time used so far by every thread of this process, in microseconds
/// (`CLOCK_PROCESS_CPUTIME_ID`). Unlike wall time it does not grow while other processes hold
/// the cores, and unlike a thread clock it counts the pipeline's workers too.
///   const double t0 = process_cpu_us(); step(); const double spent = process_cpu_us() - t0;
inline double process_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

/// CPU time used so far by the calling thread, in microseconds (`CLOCK_THREAD_CPUTIME_ID`).
///   const double t0 = thread_cpu_us(); work(); const double mine = thread_cpu_us() - t0;
inline double thread_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

/// While alive, every thread of the process (those that exist now, and those they start, which
/// inherit the mask) runs on one core only; the destructor restores each thread's previous
/// affinity, and gives threads started meanwhile the mask the process had before. Use it to measure
/// wall-time overhead without parallel speed-up hiding it.
///   { PinnedToOneCore pin; time_it(); }  // pinned to the first core this process may use
class PinnedToOneCore {
 public:
  /// Pins to `core`, or to the first core in the process's current mask when `core` is -1.
  explicit PinnedToOneCore(int core = -1) {
    cpu_set_t current;
    CPU_ZERO(&current);
    sched_getaffinity(0, sizeof current, &current);
    if (core < 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &current)) {
          core = c;
          break;
        }
      }
    }
    core_ = core;
    process_mask_ = current;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(core, &one);
    // sched_setaffinity acts on one thread: walk /proc/self/task to reach the workers as well.
    for (const auto& name : files::list("/proc/self/task")) {
      const pid_t tid = static_cast<pid_t>(std::atoi(name.c_str()));
      cpu_set_t before;
      CPU_ZERO(&before);
      if (sched_getaffinity(tid, sizeof before, &before) != 0) continue;
      if (sched_setaffinity(tid, sizeof one, &one) == 0) saved_.emplace_back(tid, before);
    }
  }
  PinnedToOneCore(const PinnedToOneCore&) = delete;
  PinnedToOneCore& operator=(const PinnedToOneCore&) = delete;
  ~PinnedToOneCore() {
    for (const auto& name : files::list("/proc/self/task")) {
      const pid_t tid = static_cast<pid_t>(std::atoi(name.c_str()));
      const cpu_set_t* mask = &process_mask_;
      for (const auto& [saved_tid, saved_mask] : saved_) {
        if (saved_tid == tid) mask = &saved_mask;
      }
      sched_setaffinity(tid, sizeof *mask, mask);
    }
  }
  /// The core every thread runs on.
  int core() const { return core_; }

 private:
  int core_ = 0;
  cpu_set_t process_mask_{};
  std::vector<std::pair<pid_t, cpu_set_t>> saved_;
};

}  // namespace stagewise::bench
