#pragma once

#include "stagewise/core/version.hpp"
#include "stagewise/threads/intra_op_threads.hpp"

#include <ATen/ThreadLocalState.h>
#include <ATen/autocast_mode.h>
#include <c10/core/ScalarType.h>

#include <thread>

// LibTorch before 2.4 keeps the autocast dtypes outside at::ThreadLocalState: they are carried here.

namespace stagewise {

/// The thread-local settings of the thread that creates it, to be applied on another thread.
///
/// Holds LibTorch's `at::ThreadLocalState` (grad mode, inference mode, the dispatch keys that
/// switch autocast on, saved-tensor hooks, profiler state), the autocast dtypes, and the
/// intra-op thread count (OpenMP's count is per thread, so a fresh thread would otherwise use its
/// own default). Capture it on the caller, then put a `ThreadStateGuard` around the work on the
/// worker.
///   stagewise::ThreadState caller;
///   std::thread([&] { stagewise::ThreadStateGuard guard(caller); run(); }).join();
class ThreadState {
 public:
  /// Captures the calling thread's settings.
  ThreadState()
      : owner_(std::this_thread::get_id()),
        intra_op_threads_(at::get_num_threads())
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
        ,
        autocast_cpu_dtype_(at::autocast::get_autocast_cpu_dtype()),
        autocast_gpu_dtype_(at::autocast::get_autocast_gpu_dtype())
#endif
  {
  }

  /// The intra-op thread count captured (`at::get_num_threads()` on the capturing thread).
  int intra_op_threads() const noexcept {
    return intra_op_threads_;
  }

 private:
  friend class ThreadStateGuard;
  at::ThreadLocalState tls_;
  std::thread::id owner_;
  int intra_op_threads_;
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
  at::ScalarType autocast_cpu_dtype_;
  at::ScalarType autocast_gpu_dtype_;
#endif
};

/// Applies a `ThreadState` to the current thread for its lifetime and restores the thread's own
/// settings afterwards (the intra-op thread count stays, as the next task sets it again).
///
/// On a thread that is not the one that captured the state, it also clears LibTorch's autocast
/// cast cache on exit (unless `keep_autocast_cache`): that cache is per thread and only the
/// capturing thread's owner clears it, so a worker's cached casts of parameters would otherwise go
/// stale after an optimizer step. An executor that runs one pass as several tasks on a worker
/// keeps the cache between them (one cast of a weight per pass, as in the unpipelined model) and
/// clears it when the pass ends.
///   stagewise::ThreadStateGuard guard(caller);  // grad mode, autocast ... as on the caller
class ThreadStateGuard {
 public:
  explicit ThreadStateGuard(const ThreadState& state, bool keep_autocast_cache = false)
      : clear_autocast_cache_(!keep_autocast_cache && std::this_thread::get_id() != state.owner_),
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
        previous_cpu_dtype_(at::autocast::get_autocast_cpu_dtype()),
        previous_gpu_dtype_(at::autocast::get_autocast_gpu_dtype()),
#endif
        tls_guard_(state.tls_) {
    use_intra_op_threads(state.intra_op_threads_);
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
    at::autocast::set_autocast_cpu_dtype(state.autocast_cpu_dtype_);
    at::autocast::set_autocast_gpu_dtype(state.autocast_gpu_dtype_);
#endif
  }

  ThreadStateGuard(const ThreadStateGuard&) = delete;
  ThreadStateGuard& operator=(const ThreadStateGuard&) = delete;

  ~ThreadStateGuard() {
    if (clear_autocast_cache_) at::autocast::clear_cache();
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
    at::autocast::set_autocast_cpu_dtype(previous_cpu_dtype_);
    at::autocast::set_autocast_gpu_dtype(previous_gpu_dtype_);
#endif
  }

 private:
  bool clear_autocast_cache_;
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
  at::ScalarType previous_cpu_dtype_;
  at::ScalarType previous_gpu_dtype_;
#endif
  at::ThreadLocalStateGuard tls_guard_;
};

}  // namespace stagewise
