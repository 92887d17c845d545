#pragma once

#include <utility>

namespace stagewise {

namespace detail {
struct CheckpointFlags {
  bool checkpointing = false;
  bool recomputing = false;
};
inline CheckpointFlags& checkpoint_flags() {
  thread_local CheckpointFlags flags;
  return flags;
}
}  // namespace detail

/// True while a checkpointed forward runs on this thread (its first, no-grad run).
///
/// Layers can use it to skip work that the recompute will redo, e.g. updating statistics once.
///   if (!stagewise::is_recomputing()) running_mean.mul_(0.9).add_(batch_mean * 0.1);
inline bool is_checkpointing() { return detail::checkpoint_flags().checkpointing; }

/// True while a checkpointed forward is being recomputed on this thread, before its backward.
inline bool is_recomputing() { return detail::checkpoint_flags().recomputing; }

namespace detail {
// Sets one flag for a scope and puts the previous value back.
class FlagScope {
 public:
  FlagScope(bool CheckpointFlags::*flag, bool value)
      : flag_(flag), before_(std::exchange(checkpoint_flags().*flag, value)) {}
  ~FlagScope() { checkpoint_flags().*flag_ = before_; }
  FlagScope(const FlagScope&) = delete;
  FlagScope& operator=(const FlagScope&) = delete;

 private:
  bool CheckpointFlags::*flag_;
  bool before_;
};
inline FlagScope checkpointing_scope() { return {&CheckpointFlags::checkpointing, true}; }
inline FlagScope recomputing_scope() { return {&CheckpointFlags::recomputing, true}; }
}  // namespace detail

}  // namespace stagewise
