// Sanitizer settings for every test binary (linked through //tests:doctest_main), every example
// and the ThreadSanitizer canary: the one place where our suppressions live, each with its
// reason. The sanitizer runtimes look these functions up when a program starts; in a build
// without that sanitizer nothing calls them.
//
// LibTorch is not instrumented (Debian's libtorch_cpu.so, libc10.so, ...): its own loads and
// stores are invisible to the sanitizers, which see only the calls it makes to functions they
// intercept (malloc/free, new/delete, memcpy/memset, pthread_*). Our code, and the LibTorch
// header code inlined into it (reference counts in c10::intrusive_ptr, Tensor accessors), is
// instrumented.

// ThreadSanitizer (--config=tsan).
//
// A `race:` suppression matches a report if any frame of either stack matches, so `race:` on a
// LibTorch library (what this project had) hides every race reached through LibTorch: our
// backward nodes, FusedStep's AccumulateGrad hooks, portals and parallel-branch backward all run
// under the autograd engine. There are none of those here. tests/sanitizers:tsan_canary_test
// proves that a race in our frames under the engine is reported with these settings, and that
// the old list hid it.
//
// called_from_lib:LIB makes every intercepted call *made from code in LIB* run uninstrumented
// (tsan_interceptors: ScopedInterceptor sets thr->in_ignored_lib when the caller's pc lies in an
// ignored library, and the interceptor then calls the real function), so the memory that LIB
// frees or copies is not recorded and its pthread calls are not seen as synchronization. It does
// not look at the rest of the stack: a race between two accesses made in our frames is reported
// whichever library called them (the canary's two races have libtorch_cpu.so below them).
//
// - called_from_lib:libtorch_cpu.so
//   What it hides: the operator delete / free and memcpy that LibTorch's compiled code does on
//   tensors that several stage threads share. Without it (no suppression at all): 2 reports in
//   //tests/optim:fused_pipe_test, 8 in //tests/skip:skip_pipe_test, 4 in
//   //tests/pipe:train_schedules_test, 3 in //tests/nn:parallel_branches_pipe_test, all alike:
//   a worker drops the last reference to a TensorImpl inside libtorch_cpu.so and it frees it,
//   while the previous reference drop on another thread was an instrumented atomic decrement in
//   our frame, or a memcpy of its sizes in at::TensorIteratorBase::compute_shape. The release /
//   acquire pair that orders them is the atomic reference count, decremented on the freeing
//   side in uninstrumented code, so TSan cannot see it. Not ours: the memory is LibTorch's, freed
//   by LibTorch once its reference count says it is unused.
//   What it costs: (a) a race between our code and a free/memcpy done by LibTorch on another
//   thread is not reported; LibTorch's other loads and stores (its kernels) are invisible to TSan
//   anyway, so such races were never reliably visible. (b) std::mutex lock/unlock compiled into
//   libtorch_cpu.so is not seen as synchronization, so an ordering LibTorch makes only through
//   its own locks would show as a false report (the threaded suites showed none), never hide one.
//   libtorch.so and libgomp.so needed no entry: no report came from them.
//
// - called_from_lib:libc10.so
//   What it hides: the same class from c10's side, seen in //tests/pipe:offload_test (2 reports,
//   2026-11-27): a worker's c10::TensorImpl::~TensorImpl (compiled into libc10.so) deletes a
//   TensorImpl in run_offload or run_forward, and the "previous read" of those bytes is another
//   worker's FileStore::put reading its own tensor's TensorImpl (sizes, nbytes, data pointer) in
//   our frame. The workers' tensors are their own cells'; the bytes are a TensorImpl allocation
//   reused by LibTorch's allocator (the new in libtorch_cpu.so is ignored by the entry above, so
//   TSan never sees the block start a new life), or the release that orders the two is a
//   reference-count decrement in uninstrumented code. Not ours for the same reason as above.
//   What it costs: as above for the frees, copies and locks done in libc10.so (c10's intrusive_ptr
//   destructors and its own mutexes); the canary (tsan_canary_test) is still reported with it.
//
// - mutex:gloo::rendezvous::PrefixStore::wait
//   What it hides: one report per process of the multi-process tests
//   (//tests/distributed:c10d_transport_test, pipe_test), "unlock of an unlocked mutex" in that
//   Gloo function while c10d's ProcessGroupGloo connects: the mutex is locked by code in
//   libtorch_cpu.so (ignored by the entry above, so TSan never sees the lock) and unlocked in
//   libgloo.so. A `mutex:` entry matches only mutex-misuse reports with that frame, no race.
//   Not `called_from_lib:libgloo.so`: ignoring Gloo's locks too hides the handoffs of its work
//   results (exceptions made on Gloo's threads and read on ours) and turned them into 36 false
//   data-race reports.
//
// - race:gloo::transport::tcp::UnboundBuffer::signalException
//   What it hides: a report seen once in //tests/distributed:c10d_transport_test (2026-11-26, the
//   case where a receive posted ahead never comes): when the timeout aborts a pending receive,
//   Gloo's thread broadcasts the buffer's condition variable in signalException (holding the
//   buffer's mutex), and our receiver thread, woken by it, destroys the Gloo buffer
//   (~UnboundBuffer, pthread_cond_destroy) as the failed work object goes. Both accesses are Gloo's
//   own, on Gloo's own condition variable, on the failure path only; no frame of ours touches
//   that memory. `race:` matches any frame of either stack, so this entry hides any race with
//   signalException on one side: Gloo's error signalling, nothing of ours.
//
// - mutex:stagewise::runtime::detail::ReleaseAfterRun
//   What it hides: "unlock of an unlocked mutex (or by a wrong thread)" with our post hook that
//   frees a node's saved tensors after it ran in a split backward's I (issue 44): 25 reports on
//   2026-11-28 in //tests/runtime:runtime and //tests/pipe:pipe, every one in that frame, the
//   first in split_backward_release_test's single-threaded cases (one thread: no other thread
//   could have held the lock). The hook calls the node's release_variables(), which takes and
//   drops the node's own mutex in LibTorch's code; TSan sees the release and not the take (the
//   entry for libtorch_cpu.so above ignores its locks, cost (b)), as with Gloo's PrefixStore. A
//   `mutex:` entry matches only mutex-misuse reports with that frame, never a data race.
//
// Not used: ignore_noninstrumented_modules=1, which would treat libstdc++.so the same way and
// so drop std::thread's start/join and std::condition_variable::wait, the synchronization that
// our own executors rely on.
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libtorch_cpu.so\n"
         "called_from_lib:libc10.so\n"
         "mutex:gloo::rendezvous::PrefixStore::wait\n"
         "mutex:stagewise::runtime::detail::ReleaseAfterRun\n"
         "race:gloo::transport::tcp::UnboundBuffer::signalException\n";
}
