#pragma once

// The one checkpointed cell: how a checkpointed forward runs, and how its recompute replays it.
// stagewise::checkpoint and the pipe's forward() use it through CheckpointFunction and
// RecomputeFunction (core/checkpoint.hpp), train_step through its F and R actions
// (runtime/program_executor.hpp). Random numbers, autocast and the checkpointing flags are handled
// here and nowhere else.

#include "stagewise/core/autocast_state.hpp"
#include "stagewise/core/checkpoint_state.hpp"
#include "stagewise/core/rng.hpp"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/types.h>

#include <optional>
#include <utility>

namespace stagewise::detail {

/// What a checkpointed forward leaves for its recompute.
struct CellReplay {
  RngState rng;            ///< the generators as the forward found them
  AutocastState autocast;  ///< the forward's autocast settings
};

/// Whether a recompute drops the autocast casts it cached. A standalone checkpoint's recompute
/// may run on an autograd engine thread that nobody else clears, so it drops them; train_step's
/// workers keep one cast of a weight per pass and clear it when the pass ends.
enum class RecomputeCasts { drop, keep };

/// Runs `body` as a checkpointed forward on a stage on `device`: without a graph, caching no
/// autocast casts (they would have no autograd history, and a later forward with grad in the same
/// region would reuse them, so their parameters would get no gradient), with `is_checkpointing()`
/// true. Returns what its recompute needs.
template <class Body>
CellReplay run_checkpointed(const torch::Device& device, Body&& body) {
  CellReplay replay{RngState::capture(device), AutocastState::capture()};
  c10::NoGradGuard no_grad;
  AutocastCacheOff no_cache;
  auto scope = checkpointing_scope();
  std::forward<Body>(body)();
  return replay;
}

/// Runs `body` as the recompute of the checkpointed forward that left `replay`: with grad, under
/// the forward's autocast settings (backward may run outside the autocast region, or on another
/// thread), with `is_recomputing()` true, and drawing the forward's random numbers unless
/// `replay_rng` is false. It is false for a stage known to draw none: such a stage runs without the
/// process-wide random-number lock, and rewinding the shared generators there would disturb a
/// stage that draws and runs at the same time.
template <class Body>
void run_recompute(const CellReplay& replay, bool replay_rng, RecomputeCasts casts, Body&& body) {
  std::optional<RngState::Restore> rng;
  if (replay_rng) rng.emplace(replay.rng);
  AutocastState::Apply autocast(replay.autocast);
  // Casts are cached like in the forward (a weight used twice casts once), then dropped if asked.
  struct DropCasts {
    bool on;
    ~DropCasts() {
      if (on) at::autocast::clear_cache();
    }
  } drop{casts == RecomputeCasts::drop && replay.autocast.enabled() &&
         replay.autocast.cache_enabled()};
  c10::AutoGradMode grad(true);
  auto scope = recomputing_scope();
  std::forward<Body>(body)();
}

}  // namespace stagewise::detail
