#pragma once

#include "stagewise/core/checkpoint_state.hpp"
#include "stagewise/runtime/detail/portal.hpp"
#include "stagewise/skip/layout.hpp"
#include "stagewise/skip/namespace.hpp"
#include "stagewise/skip/tracker.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// From the skip layer's private code.
using ::stagewise::detail::SkipLayout;

/// One micro-batch's skips in a pipe's `forward`: skips within a stage are kept plainly,
/// skips that cross stages go through portals (torchgpipe's tracker through portals).
///
/// A pipe keeps one per micro-batch, shared by that micro-batch's cells on every stage (they run
/// one after another) and by their recomputes in backward.
///   PortalTracker t(layout);  auto blue = t.save(skip, x);  auto y = t.load(skip, phony);
class PortalTracker {
 public:
  explicit PortalTracker(std::shared_ptr<const SkipLayout> layout) : layout_(std::move(layout)) {}

  /// Stashes `tensor`; for a cross-stage skip returns the phony to join into the stashing stage's
  /// output (undefined otherwise). An undefined tensor creates no portal. Under checkpointing
  /// the portal's tensor lives for 3 takes, else 2; a recomputed stash puts the tensor back into
  /// the existing portal with life 1.
  torch::Tensor save(const SkipInfo& skip, torch::Tensor tensor) {
    if (!layout_->requires_copy(skip)) {
      plain_[&skip] = std::move(tensor);
      return {};
    }
    if (!tensor.defined()) {
      undefined_.insert(&skip);  // popped as often as asked (its recompute pops it again)
      return {};
    }
    auto it = portals_.find(&skip);
    if (it == portals_.end()) {
      const int life = is_checkpointing() ? 3 : 2;
      it =
          portals_.emplace(&skip, c10::make_intrusive<Portal>(skip, std::move(tensor), life)).first;
    } else {
      it->second->put_tensor(std::move(tensor), 1);  // the recompute's stash: one take, by blue
    }
    return portal_blue(it->second);
  }

  /// Pops the tensor of `skip`: from its portal (connected to autograd through `phony`, forked
  /// off the popping stage's input) or from the plain store.
  torch::Tensor load(const SkipInfo& skip, const torch::Tensor& phony) {
    if (auto it = portals_.find(&skip); it != portals_.end())
      return portal_orange(it->second, phony);
    if (undefined_.count(&skip)) return {};
    auto it = plain_.find(&skip);
    TORCH_CHECK(it != plain_.end(), "stagewise::pop: skip ", skip.describe(),
                " has not been stashed in this micro-batch. Stash it in an earlier layer.");
    torch::Tensor out = std::move(it->second);
    plain_.erase(it);
    return out;
  }

  /// The portal of `skip`, or null (a skip within one stage, an undefined stash, not yet stashed).
  Portal* portal(const SkipInfo& skip) const {
    auto it = portals_.find(&skip);
    return it == portals_.end() ? nullptr : it->second.get();
  }
  c10::intrusive_ptr<Portal> portal_ptr(const SkipInfo& skip) const {
    auto it = portals_.find(&skip);
    return it == portals_.end() ? c10::intrusive_ptr<Portal>() : it->second;
  }
  /// True when `skip` waits in the plain store (not through a portal).
  bool holds_plainly(const SkipInfo& skip) const {
    return plain_.count(&skip) > 0 || undefined_.count(&skip) > 0;
  }
  const SkipLayout& layout() const { return *layout_; }

 private:
  std::shared_ptr<const SkipLayout> layout_;
  std::map<const SkipInfo*, torch::Tensor> plain_;
  std::map<const SkipInfo*, c10::intrusive_ptr<Portal>> portals_;
  std::set<const SkipInfo*> undefined_;
};

/// The tracker installed while one cell of a pipe's `forward` runs (its first run or its
/// recompute): stashes go to the micro-batch's PortalTracker and their phonies are collected to
/// be joined into the stage's output; pops read portals through the phony forked off the input.
class PortalCell final : public SkipTrackerBase {
 public:
  PortalCell(PortalTracker& tracker, torch::Tensor pop_phony)
      : tracker_(tracker), pop_phony_(std::move(pop_phony)) {}

  void stash(const SkipInfo& skip, torch::Tensor tensor) override {
    torch::Tensor blue = tracker_.save(skip, std::move(tensor));
    if (blue.defined()) blues_.push_back(std::move(blue));
  }
  torch::Tensor pop(const SkipInfo& skip) override { return tracker_.load(skip, pop_phony_); }

  /// The phonies of this cell's cross-stage stashes.
  const std::vector<torch::Tensor>& blues() const { return blues_; }

  /// The tracker of the cell running on this thread, or null outside a pipe's forward.
  static PortalCell* current() { return dynamic_cast<PortalCell*>(&current_skip_tracker()); }
  PortalTracker& tracker() const { return tracker_; }

 private:
  PortalTracker& tracker_;
  torch::Tensor pop_phony_;
  std::vector<torch::Tensor> blues_;
};

}  // namespace stagewise::runtime::detail
