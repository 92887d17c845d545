#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace stagewise {
namespace detail {

// One call to ThreadPool::run: indices 0..count-1, handed out one at a time to whichever thread
// asks first (a pool worker or the calling thread).
struct PoolJob {
  PoolJob(std::size_t count, const std::function<void(std::size_t)>& task)
      : count(count), task(task), errors(count) {}

  const std::size_t count;
  // Lives on the caller's stack: touched only while running a claimed index, and the caller
  // does not return before every claimed index is done.
  const std::function<void(std::size_t)>& task;
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<std::exception_ptr> errors;  // slot i is written only by the thread that ran i
  std::mutex mutex;
  std::condition_variable all_done;
  std::size_t done = 0;  // guarded by mutex

  // Claims one index and runs it (or skips it once another index failed); false when every
  // index has been claimed already.
  bool run_one() {
    const std::size_t i = next.fetch_add(1);
    if (i >= count) return false;
    if (!failed.load()) {
      try {
        task(i);
      } catch (...) {
        errors[i] = std::current_exception();
        failed.store(true);
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (++done == count) all_done.notify_all();
    return true;
  }
};

// What the workers share with the pool. Owned jointly, so that a worker never touches freed
// memory even if the pool object itself is destroyed from inside one of its own tasks.
struct PoolCore {
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::shared_ptr<PoolJob>> jobs;  // jobs that may still have unclaimed indices
  bool stopping = false;

  void work() {
    for (;;) {
      std::shared_ptr<PoolJob> job;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stopping || !jobs.empty(); });
        if (jobs.empty()) return;
        job = jobs.front();
      }
      if (!job->run_one()) retire(job);
    }
  }

  void retire(const std::shared_ptr<PoolJob>& job) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = std::find(jobs.begin(), jobs.end(), job);
    if (it != jobs.end()) jobs.erase(it);
  }
};

}  // namespace detail

/// A persistent pool of threads for fork-join work in which the calling thread takes part.
///
/// `size()` is how many tasks run at once: the pool owns `size() - 1` worker threads and the
/// thread that calls `run` works too instead of idling, so `ThreadPool(1)` runs everything on the
/// caller, one task after another. The default size is the number of hardware threads. A task
/// may itself call `run` on the same pool (nested fork-join): a waiting thread only ever waits for
/// tasks that other threads are already running, so nesting cannot deadlock. The destructor joins
/// the workers; destroy a pool only when no `run` is in progress.
///   stagewise::ThreadPool pool(4);
///   pool.run(8, [&](std::size_t i) { out[i] = work(i); });  // returns when all 8 are done
class ThreadPool {
 public:
  /// A pool that runs `size` tasks at once (the caller included); `size` must be at least 1.
  explicit ThreadPool(std::size_t size = default_size())
      : core_(std::make_shared<detail::PoolCore>()), size_(size) {
    TORCH_CHECK(size >= 1,
                "stagewise::ThreadPool: size must be at least 1 (the calling thread "
                "counts as one); got 0. Use ThreadPool(1) to run tasks one after "
                "another on the caller.");
    workers_.reserve(size - 1);
    for (std::size_t i = 1; i < size; ++i) {
      workers_.emplace_back([core = core_] { core->work(); });
    }
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(core_->mutex);
      core_->stopping = true;
    }
    core_->wake.notify_all();
    for (auto& worker : workers_) {
      // Destroyed from one of its own tasks (the last owner let go there): that worker cannot
      // join itself; it exits on its own once the task returns, as it only uses `core_`.
      if (worker.get_id() == std::this_thread::get_id()) {
        worker.detach();
      } else {
        worker.join();
      }
    }
  }

  /// The number of hardware threads (at least 1): the default size.
  static std::size_t default_size() {
    return std::max<std::size_t>(1, std::thread::hardware_concurrency());
  }

  /// How many tasks run at once, the calling thread included.
  std::size_t size() const noexcept { return size_; }

  /// Runs `task(0) .. task(count - 1)` on the workers and the calling thread and returns when all
  /// have finished. If tasks throw, the tasks not yet started are skipped, the running ones
  /// finish, and the exception of the lowest-numbered failed task is rethrown unchanged.
  void run(std::size_t count, const std::function<void(std::size_t)>& task) {
    if (count == 0) return;
    auto job = std::make_shared<detail::PoolJob>(count, task);
    const bool share = count > 1 && !workers_.empty();
    if (share) {
      {
        std::lock_guard<std::mutex> lock(core_->mutex);
        core_->jobs.push_back(job);
      }
      if (count - 1 >= workers_.size()) {
        core_->wake.notify_all();
      } else {
        for (std::size_t i = 0; i + 1 < count; ++i) core_->wake.notify_one();
      }
    }
    while (job->run_one()) {
    }
    {
      std::unique_lock<std::mutex> lock(job->mutex);
      job->all_done.wait(lock, [&] { return job->done == count; });
    }
    if (share) core_->retire(job);
    // Take the exceptions out of the job here: a worker may still hold the job and would
    // otherwise free an exception the caller is handling.
    std::exception_ptr first;
    for (auto& error : job->errors) {
      if (error && !first) first = error;
      error = nullptr;
    }
    if (first) std::rethrow_exception(first);
  }

 private:
  std::shared_ptr<detail::PoolCore> core_;
  std::size_t size_;
  std::vector<std::thread> workers_;
};

/// The process-wide pool that `parallel_branches` uses unless given another: `default_size()`
/// threads (the caller included), created on first use and joined at exit.
///   auto pool = stagewise::default_thread_pool();  // pool->size() == hardware threads
inline std::shared_ptr<ThreadPool> default_thread_pool() {
  static const auto pool = std::make_shared<ThreadPool>();
  return pool;
}

}  // namespace stagewise
