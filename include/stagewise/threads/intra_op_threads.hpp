#pragma once

#include <ATen/Parallel.h>

namespace stagewise {

/// Gives the calling thread `count` intra-op threads, the one place stagewise sets that count.
///
/// OpenMP keeps the count per thread, so a task run on another thread must carry its poster's
/// count there. `at::set_num_threads` also sets the process-wide default, so it is called only
/// when this thread's count differs, which never happens with a process-wide (non-OpenMP) pool.
inline void use_intra_op_threads(int count) {
  if (at::get_num_threads() != count) at::set_num_threads(count);
}

}  // namespace stagewise
