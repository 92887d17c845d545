#pragma once

// The parts of a pipe's step that depend on its processes and replicas (PipeOverImpl): the
// schedule's placement checked against the transport's processes, the loss shared from the last
// stage's process (with the rows the replicas' mean weighs), and a fused step on averaged
// gradients.

#include "stagewise/core/batch.hpp"
#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/pipe/replicas.hpp"
#include "stagewise/runtime/processes.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

// Refuses a schedule that places the stages on `workers` workers as `placement` says (stage j
// on worker placement[j]) where the pipe cannot run them: in one process, at most one worker per
// stage; between processes, one worker per process, running exactly its stages. `fix` (how to
// build a pipe for another placement) ends the error; empty: a generic one.
inline void check_placement(const runtime::Processes& here, const std::vector<int>& placement,
                            int workers, const std::string& where, const std::string& fix) {
  const int n = static_cast<int>(placement.size());
  if (here.stage.empty()) {
    TORCH_CHECK(workers <= n, where, ": the schedule plans ", workers, " workers for ", n,
                " stages; a pipe runs at most one worker per stage");
    return;
  }
  // The pipe's worker of each process: processes in rank order.
  std::vector<int> ranks = here.stage;
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  const int processes = static_cast<int>(ranks.size());
  const std::string how =
      "; " + (fix.empty() ? std::string("pass a schedule that runs each process's stages (the "
                                        "transport's processes()) on a worker of their own")
                          : fix);
  TORCH_CHECK(workers == processes, where, ": the schedule runs the ", n, " stages on ", workers,
              " workers but the pipe runs them on ", processes, " ranks", how);
  for (int j = 0; j < n; ++j) {
    const int rank = here.stage[static_cast<std::size_t>(j)];
    const int worker =
        static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), rank) - ranks.begin());
    TORCH_CHECK(placement[static_cast<std::size_t>(j)] == worker, where,
                ": the schedule runs stage ", j, " on worker ",
                placement[static_cast<std::size_t>(j)], " but the pipe keeps it on rank ", rank,
                how);
  }
}

// A fused step on a data-parallel pipe: the fused step's hooks are off during the step (they
// would step on this replica's gradients alone); the reductions step each parameter on its
// average instead (or, in a clip's norm pass, measure it), and the hooks are back afterwards,
// with no gradient left pending.
template <pipe_replicas Replicas, class Run>
torch::Tensor with_reduced_fused_step(Replicas& replicas, optim::FusedStep& fused, Run&& run) {
  const bool attached = fused.attached();
  if (attached) fused.detach();
  auto restore = [&](bool done) {
    replicas.step_after_reduction(nullptr);
    FusedStepAccess::defer_offload_finish(fused, false);
    if (attached) fused.attach();
    if (done) {
      FusedStepAccess::reset_counts(fused);  // a clip's norm pass keeps the norms it measured
    } else {
      fused.reset_step();
    }
  };
  torch::Tensor loss;
  try {
    // Offloaded parameters' host steps all run beside the step, and their updates apply at its
    // end (as in one process, where finish_step applies them); with sharded optimizer state each
    // owner's updates apply as its bucket is stepped, for the owner sends them right after.
    FusedStepAccess::defer_offload_finish(fused, !replicas.sharded());
    replicas.step_after_reduction(&fused);
    loss = run();
    FusedStepAccess::finish_offload(fused);
  } catch (...) {
    restore(false);
    throw;
  }
  restore(true);
  return loss;
}

// The step's loss on every process, after the step's work: the last stage's process (worker
// `from`; `last`: this one) holds it. With replicas, it travels with its dtype and the replica's
// rows (of `target`), which the replicas' mean weighs, and the replicas finish their reductions.
template <class Transport, pipe_replicas Replicas>
torch::Tensor share_loss(Transport& transport, Replicas& replicas, torch::Tensor loss,
                         const Batch& target, bool last, int from, const std::string& where) {
  const std::string gone =
      ": this process stopped before the step's loss arrived (it "
      "aborted); build a new pipe";
  if (!replicas.many()) {
    loss = transport.share(loss, from, /*index=*/1);
    TORCH_CHECK(loss.defined(), where, gone);
    return loss;
  }
  torch::Tensor value;
  if (last) {
    const auto rows = static_cast<double>(target[0].size(0));
    const auto dtype = static_cast<double>(static_cast<int>(loss.scalar_type()));
    value =
        torch::stack({loss.detach().to(torch::kCPU, torch::kDouble).reshape({}),
                      torch::tensor(rows, torch::kDouble), torch::tensor(dtype, torch::kDouble)});
  }
  const torch::Tensor shared = transport.share(value, from, /*index=*/1);
  TORCH_CHECK(shared.defined(), where, gone);
  if (!last) {
    const auto dtype = static_cast<c10::ScalarType>(shared[2].item<double>());
    loss = shared[0].to(dtype);
  }
  return replicas.finish(loss, static_cast<std::int64_t>(shared[1].item<double>()));
}

}  // namespace stagewise::detail
