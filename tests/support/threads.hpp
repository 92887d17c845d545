#pragma once

// Counting this process's threads, for tests that check that threads are joined.

#include <dirent.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <thread>

namespace stagewise::testing {

/// The threads of this process now, from /proc/self/task. (POSIX calls, not std::filesystem:
/// Python's torch wheel exports its own copy of std::filesystem, which a program linked to it
/// calls by mistake.)
inline std::size_t thread_count() {
  std::size_t n = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return 0;
  while (const dirent* entry = readdir(dir)) {
    if (std::strcmp(entry->d_name, ".") != 0 && std::strcmp(entry->d_name, "..") != 0) ++n;
  }
  closedir(dir);
  return n;
}

/// The thread count once it has settled at `expected`, or whatever it is after two seconds.
/// A thread can stay listed in /proc for a moment after pthread_join has returned (the kernel
/// reaps it just after waking the joiner), and the OpenMP team threads of a joined worker that ran
/// a parallel region exit on their own just after it: neither is a leak, and a bare count right
/// after a join fails now and then (seen in about one run in three of the thread-pool test).
inline std::size_t settled_thread_count(std::size_t expected) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::size_t n = thread_count();
  while (n != expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    n = thread_count();
  }
  return n;
}

/// The thread count once it has stopped changing (the same for 100 ms), or whatever it is after
/// two seconds: the count to compare against later. A bare count taken just after an earlier
/// test joined its threads can still include one that is exiting (see above), and then every
/// later comparison is off by one (seen once in CI: the worker test's "before + 3" read 4 == 5).
inline std::size_t stable_thread_count() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::size_t n = thread_count();
  int same = 0;
  while (same < 20 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const std::size_t now = thread_count();
    same = now == n ? same + 1 : 0;
    n = now;
  }
  return n;
}

}  // namespace stagewise::testing
