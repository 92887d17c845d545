#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/core/dependency.hpp"
#include "stagewise/core/error_context.hpp"
#include "stagewise/runtime/fan_out.hpp"
#include "stagewise/runtime/detail/forward_skips.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/schedule/clock.hpp"
#include "stagewise/skip/layout.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace stagewise::runtime {

/// torchgpipe's forward: runs the clock cycles of `clock_cycles(m, n)` one after another, the
/// cells of a cycle concurrently on their stages' workers, and returns the gathered output,
/// connected to autograd (the caller runs backward). Before cell (i, j) with i > 0, micro-batch
/// i-1's value is forked and joined into micro-batch i's, so backward on each stage runs the
/// micro-batches in the order m-1 .. 0. A stage's exception is rethrown after its cycle with its
/// type and text, its stage and micro-batch recorded (`error_context`); later cycles never run.
/// `skips` routes the skip connections (through portals). The input may be on any device: each
/// micro-batch moves to stage 0's; the output is on the last stage's device.
inline Batch run_clock_cycles(std::vector<std::unique_ptr<StageRuntime>>& stages,
                              const Batch& input, int64_t chunks,
                              const std::vector<Checkpoint>& modes, bool training,
                              std::shared_ptr<const ::stagewise::detail::SkipLayout> skips = {}) {
  std::vector<Batch> batches = scatter(input, chunks);
  const int m = static_cast<int>(batches.size());
  const int n = static_cast<int>(stages.size());
  TORCH_CHECK(modes.size() == stages.size(), "stagewise::run_clock_cycles: ", modes.size(),
              " checkpoint modes for ", stages.size(), " stages; give one per stage");
  const std::vector<int64_t> stops = checkpoint_stops(modes, m, training);
  ::stagewise::runtime::detail::ForwardSkips portals(std::move(skips), batches.size());
  StreamFence fence(stages);

  std::vector<std::optional<Batch>> outs(static_cast<std::size_t>(n));
  std::vector<Worker*> workers;
  workers.reserve(static_cast<std::size_t>(n));
  // One autocast cast per weight and pass, as on the caller's thread: the cells of a stage keep
  // their worker's cast cache between cycles, and every worker's cache is cleared at the end.
  std::vector<Worker*> all_workers;
  for (auto& s : stages) all_workers.push_back(&s->worker);
  struct ClearCaches {
    std::vector<Worker*>& ws;
    ~ClearCaches() { clear_autocast_caches(ws); }
  } clear_at_end{all_workers};
  for (const auto& cycle : schedule::clock_cycles(m, n)) {
    for (const auto& c : cycle) {
      auto& b = batches[c.micro];
      if (c.micro != 0) {
        auto& prev = batches[c.micro - 1];
        auto [kept, phony] = fork(prev[0]);
        prev.set(0, kept);
        b.set(0, join(b[0], phony));
      }
      // Stage 0 takes the caller's micro-batch (on this thread's streams) onto its device.
      const StageRuntime* from = c.stage != 0 ? stages[c.stage - 1].get() : nullptr;
      b = stages[c.stage]->receive(b, from, c.micro);
      portals.copy_into(b, c.micro, c.stage, stages);
    }
    workers.clear();
    for (const auto& c : cycle) workers.push_back(&stages[c.stage]->worker);
    fan_out(
        workers,
        [&](std::size_t k) {
          const auto c = cycle[k];
          const ErrorContext where{c.stage, c.micro, Phase::forward};
          try {
            const int64_t stop = stops[static_cast<std::size_t>(c.stage)];
            outs[k].emplace(stages[c.stage]->run(batches[c.micro], c.micro < stop, stop > 0, training,
                                                 portals.wrapper(c.micro, c.stage), where));
          } catch (...) {
            ::stagewise::detail::annotate_current_exception(where);
            throw;
          }
        },
        AutocastCache::keep);
    for (std::size_t k = 0; k < cycle.size(); ++k) {
      batches[cycle[k].micro] = std::move(*outs[k]);
      outs[k].reset();
    }
  }
  fence.leave();  // the caller's streams wait for the outputs before gather reads them
  return gather(batches);
}

}  // namespace stagewise::runtime
