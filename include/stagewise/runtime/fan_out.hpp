#pragma once

#include "stagewise/threads/thread_state.hpp"
#include "stagewise/threads/worker.hpp"

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <span>
#include <vector>

namespace stagewise::runtime {

/// Runs `task(k)` on `workers[k]` for every non-null worker, all at once, and returns when every
/// one has finished: the one fan-out/join of the executors. Each task runs under the caller's
/// full thread state (`ThreadState`: grad and inference mode, autocast enabled and dtypes,
/// intra-op threads); when it ends, the worker's autocast cast cache is cleared, so no worker
/// keeps a low-precision copy of a weight the optimizer then changes. With
/// `AutocastCache::keep` the cache survives the task: a pass split into several fan-outs keeps
/// one cast per weight, like the unpipelined model, and ends with `clear_autocast_caches`. The
/// first exception, by task index, is rethrown unchanged after all tasks finished.
///   std::vector<Worker*> ws = {&a, &b};
///   stagewise::runtime::fan_out(ws, [&](std::size_t k) { run_part(k); });
enum class AutocastCache { clear, keep };

template <class Task>
void fan_out(std::span<Worker* const> workers, Task&& task,
             AutocastCache cache = AutocastCache::clear) {
  const ThreadState caller;
  std::vector<std::exception_ptr> errors(workers.size());
  std::mutex mutex;
  std::condition_variable done;
  std::size_t pending = 0;
  for (auto* w : workers) pending += w != nullptr ? 1 : 0;
  for (std::size_t k = 0; k < workers.size(); ++k) {
    if (workers[k] == nullptr) continue;
    workers[k]->post([&, k] {
      try {
        ThreadStateGuard guard(caller, cache == AutocastCache::keep);
        task(k);
      } catch (...) {
        errors[k] = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (--pending == 0) done.notify_one();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [&] { return pending == 0; });
  }
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

/// Clears the autocast cast cache of every non-null worker (the end of a pass that ran its
/// fan-outs with `AutocastCache::keep`). Never throws: a pass that failed still ends here.
inline void clear_autocast_caches(std::span<Worker* const> workers) noexcept {
  try {
    fan_out(workers, [](std::size_t) {});
  } catch (...) {
  }
}

}  // namespace stagewise::runtime
