#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/dependency.hpp"
#include "stagewise/runtime/detail/portal.hpp"
#include "stagewise/runtime/detail/portal_tracker.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/skip/layout.hpp"
#include "stagewise/skip/tracker.hpp"

#include <torch/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// From the skip layer's private code.
using ::stagewise::detail::LayerFrame;
using ::stagewise::detail::SkipLayout;

/// What a pipe's `forward` (the clock-cycle executor) does for skip connections: one
/// PortalTracker per micro-batch, the portal copies between devices before a cell, and the
/// wrapper that installs the cell's tracker while the stage runs. Does nothing for a pipe
/// without skips.
class ForwardSkips {
 public:
  ForwardSkips(std::shared_ptr<const SkipLayout> layout, std::size_t micro_batches) {
    if (!layout || layout->empty()) return;
    layout_ = std::move(layout);
    trackers_.reserve(micro_batches);
    for (std::size_t i = 0; i < micro_batches; ++i) {
      trackers_.push_back(std::make_shared<PortalTracker>(layout_));
    }
  }

  bool active() const { return layout_ != nullptr; }

  /// Before cell (i, j), on the scheduling thread: moves each portal routed into stage j to
  /// j's device when it lives elsewhere (sorted by source stage). The copy is ordered in
  /// autograd by a fork/join on the micro-batch.
  void copy_into(Batch& batch, std::size_t i, std::size_t j,
                 std::vector<std::unique_ptr<runtime::StageRuntime>>& stages) {
    if (!active() || !layout_->has_copies()) return;
    runtime::StageRuntime& to = *stages[j];
    for (const auto& r : layout_->copies_into(j)) {
      runtime::StageRuntime& from = *stages[r.stash_stage];
      if (from.device == to.device) continue;
      auto portal = trackers_[i]->portal_ptr(*r.skip);
      if (!portal) continue;  // an undefined stash: nothing to move
      auto route = c10::make_intrusive<PortalRoute>(from.device, from.compute, from.copy_stream(i),
                                                    to.device, to.copy_stream(i), to.compute);
      auto [kept, phony] = fork(batch[0]);
      batch.set(0, join(kept, portal_copy(portal, phony, route)));
    }
  }

  /// The wrapper for cell (i, j): installs a PortalCell and stage j's declarations, forks the
  /// input for the pops that arrive by portal, and joins the stashes' phonies into the output.
  runtime::cell_wrapper wrapper(std::size_t i, std::size_t j) const {
    if (!active()) return nullptr;
    return [tracker = trackers_[i], layout = layout_, j](const Batch& in,
                                                         const runtime::stage_call& fn) {
      Batch batch = in;
      torch::Tensor pop_phony;
      if (!layout->copies_into(j).empty()) {  // some skip arrives by portal
        auto [kept, phony] = fork(batch[0]);
        batch.set(0, kept);
        pop_phony = phony;
      }
      PortalCell cell(*tracker, pop_phony);
      UseSkipTracker use(cell);
      LayerFrame frame(layout->stage(j), [j] { return "stage " + std::to_string(j); });
      Batch out = fn(batch);
      frame.finish();
      for (const auto& blue : cell.blues()) out.set(0, join(out[0], blue));
      return out;
    };
  }

  /// Micro-batch i's tracker (for tests and diagnostics).
  PortalTracker* tracker(std::size_t i) const {
    return i < trackers_.size() ? trackers_[i].get() : nullptr;
  }

 private:
  std::shared_ptr<const SkipLayout> layout_;
  std::vector<std::shared_ptr<PortalTracker>> trackers_;
};

}  // namespace stagewise::runtime::detail
