#pragma once

#include <cstdint>
#include <string>

namespace stagewise::runtime {

/// How a GradientReducer groups and reduces gradients.
struct ReducerOptions {
  /// Bytes of gradients per bucket (one all-reduce each); 25 MiB by default, as PyTorch's DDP.
  std::int64_t bucket_bytes = 25 * 1024 * 1024;
  /// Whether a parameter that got a gradient on some ranks but not others in a backward is
  /// reduced with zeros from those (what one process on the whole batch computes), rather than
  /// being an error. A parameter no rank used keeps its gradient untouched either way.
  bool unused_parameters = false;
  /// Opens every error ("stagewise::distributed::DataParallel").
  std::string who = "stagewise::runtime::GradientReducer";
  /// Whether backward drives the reduction (hooks on the parameters' gradient accumulators, from
  /// `mark`ed outputs); false: the caller does, with `launch()` once the gradients are final and
  /// `complete()` (a pipeline stage after its last backward of a step).
  bool from_backward = true;
  /// The option that allows partly used parameters, as the error for them names it.
  std::string unused_fix = "DataParallelOptions().unused_parameters(true)";
};

}  // namespace stagewise::runtime
