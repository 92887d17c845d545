#pragma once

// What both pipes (one process and distributed) do around a training step: check the rows of its
// input and target, weight each micro-batch's loss by its rows, and wrap a fused optimizer step.

#include "stagewise/core/batch.hpp"
#include "stagewise/pipe/fused_stepper.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace stagewise::detail {

/// Checks a step's batches: every tensor of the input and of the target has a batch dimension with
/// the same, positive number of rows (the loss of a row needs its target row). Either may be null:
/// a distributed rank checks only what it holds (the input on the first stage's rank, the target
/// on the last's). `who` opens each message ("stagewise::Pipe::train_step").
inline void check_step_rows(const Batch* input, const Batch* target, const char* who) {
  if (input == nullptr && target == nullptr) return;
  auto name = [](const Batch& b, const char* what, std::size_t k) {
    return b.atomic() ? std::string("the ") + what
                      : std::string(what) + " tensor " + std::to_string(k);
  };
  auto check_tensor = [&](const Batch& b, const char* what, std::size_t k) {
    TORCH_CHECK(b[k].defined(), who, ": ", name(b, what, k),
                " is undefined; give a tensor whose first dimension is the batch");
    TORCH_CHECK(b[k].dim() > 0, who, ": ", name(b, what, k),
                " is a scalar; give a tensor whose first dimension is the batch (unsqueeze(0) "
                "it)");
  };
  // The input's rows, or the target's on a rank that holds only the target.
  const Batch& lead = input != nullptr ? *input : *target;
  const char* what = input != nullptr ? "input" : "target";
  check_tensor(lead, what, 0);
  const int64_t rows = lead[0].size(0);
  TORCH_CHECK(rows > 0, who, ": the batch is empty (", name(lead, what, 0),
              " has 0 rows); a step needs at least one row, so skip empty batches");
  for (std::size_t k = 1; k < lead.size(); ++k) {
    check_tensor(lead, what, k);
    TORCH_CHECK(lead[k].size(0) == rows, who, ": ", what, " tensor ", k, " has ", lead[k].size(0),
                " rows but ", what, " tensor 0 has ", rows, "; every tensor of the ", what,
                " must have one row per example");
  }
  if (input == nullptr || target == nullptr) return;
  for (std::size_t k = 0; k < target->size(); ++k) {
    check_tensor(*target, "target", k);
    TORCH_CHECK((*target)[k].size(0) == rows, who, ": ", name(*target, "target", k), " has ",
                (*target)[k].size(0), " rows but the input has ", rows,
                "; give one target row per input row");
  }
}

/// Each micro-batch's share of the mini-batch's rows: the weight of its mean loss.
inline std::vector<double> row_weights(const std::vector<Batch>& micro_batches) {
  double rows = 0;
  for (const auto& b : micro_batches) rows += static_cast<double>(b[0].size(0));
  std::vector<double> out;
  out.reserve(micro_batches.size());
  for (const auto& b : micro_batches) out.push_back(static_cast<double>(b[0].size(0)) / rows);
  return out;
}

/// Runs `run(before)` as a step with `fused` inside backward: `before(m)` tells it the step's m
/// micro-batches (every stage back-propagates each once, whatever the checkpoint mode); a step
/// that fails leaves no half-accumulated state (`reset_step`), one that succeeds is finished.
template <fused_stepper Fused, class Run>
torch::Tensor with_fused_step(Fused& fused, Run&& run) {
  torch::Tensor loss;
  try {
    loss = run([&](int micro_batches) { fused.set_accumulation_steps(micro_batches); });
  } catch (...) {
    fused.reset_step();
    throw;
  }
  fused.finish_step();
  return loss;
}

}  // namespace stagewise::detail
