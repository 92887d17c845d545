#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#if defined(__SANITIZE_THREAD__)
// Under ThreadSanitizer (./bazelw test --config=tsan): LibTorch itself is not instrumented, so the
// synchronization inside it (reference counts of tensors and autograd nodes, its thread pools) is
// invisible and every hand-off of a tensor between threads looks like a race. Reports with a frame
// inside LibTorch's libraries are therefore suppressed; races between stagewise's own frames are
// still reported.
extern "C" const char* __tsan_default_suppressions() {
  return "race:libtorch_cpu.so\n"
         "race:libtorch.so\n"
         "race:libc10.so\n"
         "race:libgomp.so\n"
         "race:libdnnl.so\n";
}
#endif
