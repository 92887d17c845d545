#pragma once

#include "stagewise/skip/namespace.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace stagewise {

/// Where `stash` and `pop` put and take tensors. A pipe installs its own for each cell it runs
/// (so skips travel between stages and micro-batches stay apart); everywhere else each thread
/// has a plain one, `SkipTracker::of_this_thread()`, and a stash is popped later on the same
/// thread.
class SkipTrackerBase {
 public:
  virtual ~SkipTrackerBase() = default;
  /// Keeps `tensor` (possibly undefined) under `skip` until it is popped.
  virtual void stash(const SkipInfo& skip, torch::Tensor tensor) = 0;
  /// Takes the tensor stashed under `skip`.
  virtual torch::Tensor pop(const SkipInfo& skip) = 0;
};

/// The plain tracker: a map from skip to tensor, no autograd tricks (a skip within one stage, or
/// outside a pipe). Popping what was not stashed is an error naming the skip.
///   stagewise::SkipTracker tracker;  stagewise::UseSkipTracker use(tracker);
class SkipTracker : public SkipTrackerBase {
 public:
  void stash(const SkipInfo& skip, torch::Tensor tensor) override {
    tensors_[&skip] = std::move(tensor);
  }
  torch::Tensor pop(const SkipInfo& skip) override {
    auto it = tensors_.find(&skip);
    TORCH_CHECK(it != tensors_.end(), "stagewise::pop: skip ", skip.describe(),
                " has not been stashed. Stash it before popping it: outside a pipe, stash<...> "
                "and pop<...> must run on the same thread, the stash first.");
    torch::Tensor out = std::move(it->second);
    tensors_.erase(it);
    return out;
  }
  /// True when `skip` is stashed and not popped yet.
  bool contains(const SkipInfo& skip) const { return tensors_.count(&skip) > 0; }
  /// Number of skips stashed and not popped.
  std::size_t size() const { return tensors_.size(); }
  /// Drops every stashed tensor (e.g. after running only an encoder outside a pipe).
  void clear() { tensors_.clear(); }

  /// This thread's plain tracker, used where no other is installed.
  static SkipTracker& of_this_thread() {
    thread_local SkipTracker tracker;
    return tracker;
  }

 private:
  std::map<const SkipInfo*, torch::Tensor> tensors_;
};

namespace detail {
inline SkipTrackerBase*& installed_tracker() {
  thread_local SkipTrackerBase* tracker = nullptr;
  return tracker;
}

// What one layer (or one stage) declares, for the run-time checks made while it runs.
struct SkipDeclarations {
  std::vector<const SkipInfo*> stashes;
  std::vector<const SkipInfo*> pops;
};

// A layer running now, innermost last: stash and pop check the skip against its declarations,
// and when it returns, every declared skip must have been used.
class LayerFrame;
inline LayerFrame*& top_frame() {
  thread_local LayerFrame* frame = nullptr;
  return frame;
}

class LayerFrame {
 public:
  // `who` is called only to build a message, e.g. "stage 1" or "DownImpl<Encoder1>".
  LayerFrame(const SkipDeclarations& declared, std::function<std::string()> who)
      : declared_(declared), who_(std::move(who)), parent_(std::exchange(top_frame(), this)) {}
  ~LayerFrame() { top_frame() = parent_; }
  LayerFrame(const LayerFrame&) = delete;
  LayerFrame& operator=(const LayerFrame&) = delete;

  // Call after the layer returned normally: every declared skip was stashed or popped.
  void finish() {
    for (const auto* skip : declared_.stashes) {
      TORCH_CHECK(used(stashed_, skip), "stagewise: ", who_(), " declares that it stashes skip ",
                  skip->describe(),
                  " but did not stash it. Call stash<...>(tensor) in its forward (an undefined "
                  "tensor sends nothing), or remove the skip from its stagewise::stashes<...>.");
    }
    for (const auto* skip : declared_.pops) {
      TORCH_CHECK(used(popped_, skip), "stagewise: ", who_(), " declares that it pops skip ",
                  skip->describe(),
                  " but did not pop it. Call pop<...>() in its forward, or remove the skip from "
                  "its stagewise::pops<...>.");
    }
    if (parent_ != nullptr) {
      parent_->stashed_.insert(parent_->stashed_.end(), stashed_.begin(), stashed_.end());
      parent_->popped_.insert(parent_->popped_.end(), popped_.begin(), popped_.end());
    }
  }

  void on_stash(const SkipInfo& skip) {
    TORCH_CHECK(used(declared_.stashes, &skip), "stagewise::stash: ", who_(), " stashes skip ",
                skip.describe(),
                ", which it does not declare. Add it to the layer's stagewise::stashes<...>.");
    stashed_.push_back(&skip);
  }
  void on_pop(const SkipInfo& skip) {
    TORCH_CHECK(used(declared_.pops, &skip), "stagewise::pop: ", who_(), " pops skip ",
                skip.describe(),
                ", which it does not declare. Add it to the layer's stagewise::pops<...>.");
    popped_.push_back(&skip);
  }

 private:
  static bool used(const std::vector<const SkipInfo*>& list, const SkipInfo* skip) {
    return std::find(list.begin(), list.end(), skip) != list.end();
  }

  const SkipDeclarations& declared_;
  std::function<std::string()> who_;
  LayerFrame* parent_;
  std::vector<const SkipInfo*> stashed_;
  std::vector<const SkipInfo*> popped_;
};
}  // namespace detail

/// Installs `tracker` for this thread for the scope's lifetime (the previous one comes back).
///   stagewise::SkipTracker mine;
///   { stagewise::UseSkipTracker use(mine); encoder->forward(x); }  // stashes land in `mine`
class UseSkipTracker {
 public:
  explicit UseSkipTracker(SkipTrackerBase& tracker)
      : previous_(std::exchange(detail::installed_tracker(), &tracker)) {}
  ~UseSkipTracker() { detail::installed_tracker() = previous_; }
  UseSkipTracker(const UseSkipTracker&) = delete;
  UseSkipTracker& operator=(const UseSkipTracker&) = delete;

 private:
  SkipTrackerBase* previous_;
};

/// The tracker `stash` and `pop` use on this thread now: the one a pipe installed for the cell
/// running here, or this thread's plain tracker.
inline SkipTrackerBase& current_skip_tracker() {
  SkipTrackerBase* installed = detail::installed_tracker();
  return installed != nullptr ? *installed : SkipTracker::of_this_thread();
}

namespace detail {
inline void stash_now(const SkipInfo& skip, torch::Tensor tensor) {
  if (LayerFrame* frame = top_frame()) frame->on_stash(skip);
  current_skip_tracker().stash(skip, std::move(tensor));
}
inline torch::Tensor pop_now(const SkipInfo& skip) {
  if (LayerFrame* frame = top_frame()) frame->on_pop(skip);
  return current_skip_tracker().pop(skip);
}
}  // namespace detail

/// Stashes `tensor` under skip `S` for a later layer to pop, possibly in a later stage. An
/// undefined tensor is allowed: the pop then returns an undefined tensor.
///
/// Inside a `Skippable` layer, prefer the member `stash<S>(t)` (or `stash<S>(this, t)` in a
/// class template): they check at compile time that the layer declares `S`. This form is checked
/// at run time against the running layer's declarations.
///   stagewise::stash<skip_x>(x);
template <skip_type S>
void stash(torch::Tensor tensor) {
  detail::stash_now(skip_info_of<S>, std::move(tensor));
}

/// Takes the tensor stashed under skip `S` (by an earlier layer, possibly in an earlier stage).
///   auto x = stagewise::pop<skip_x>();
template <skip_type S>
torch::Tensor pop() {
  return detail::pop_now(skip_info_of<S>);
}

}  // namespace stagewise
