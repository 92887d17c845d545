#pragma once

// Layers the distributed pipe tests put in their models: a skip connection's two ends (Stash
// stashes its input for a later stage, Pop adds it back) and a Trap that throws, or kills its
// process, in a chosen forward call.

#include "stagewise/skip/skippable.hpp"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <signal.h>

namespace stagewise::testing {

struct PipeLayersNs {};
using skip_x = skip<PipeLayersNs, "x">;

/// Stashes its input for a later stage (on another rank) and passes it on.
struct StashImpl : Skippable<StashImpl, stashes<skip_x>> {
  torch::Tensor forward(torch::Tensor x) {
    ::stagewise::stash<skip_x>(this, x);
    return x;
  }
};
TORCH_MODULE(Stash);

/// Adds the stashed tensor back.
struct PopImpl : Skippable<PopImpl, pops<skip_x>> {
  torch::Tensor forward(torch::Tensor x) { return x + ::stagewise::pop<skip_x>(this); }
};
TORCH_MODULE(Pop);

/// Throws "trap sprung in forward" (or, with `kill`, kills its process) in forward call `at`
/// (counting from 0, recomputes included), on whichever rank runs it; never with `at` -1.
struct TrapImpl : torch::nn::Module {
  int calls = 0;
  int at = -1;
  bool kill = false;
  torch::Tensor forward(torch::Tensor x) {
    if (calls++ == at) {
      if (kill) ::raise(SIGKILL);
      TORCH_CHECK(false, "trap sprung in forward");
    }
    return x;
  }
};
TORCH_MODULE(Trap);

}  // namespace stagewise::testing
