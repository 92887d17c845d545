#pragma once

#include "stagewise/threads/intra_op_threads.hpp"

#include <ATen/Parallel.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace stagewise {

/// One thread that runs posted tasks in order: a pipeline stage's worker.
///
/// Tasks must not throw (executors catch and hand exceptions back). The destructor finishes the
/// queued tasks and joins the thread. Each task runs with the intra-op thread count its poster
/// had, since OpenMP keeps that count per thread.
///   stagewise::Worker w;  w.post([] { ... });
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Queues `task` to run on this worker's thread.
  void post(std::function<void()> task) {
    const int threads = at::get_num_threads();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back({std::move(task), threads});
    }
    ready_.notify_one();
  }

  std::thread::id id() const { return thread_.get_id(); }

 private:
  struct Item {
    std::function<void()> task;
    int threads;
  };

  void loop() {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything queued has run
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      use_intra_op_threads(item.threads);
      item.task();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace stagewise
