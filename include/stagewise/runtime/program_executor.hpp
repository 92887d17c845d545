#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/detail/cell.hpp"
#include "stagewise/core/error_context.hpp"
#include "stagewise/runtime/cell_runs.hpp"
#include "stagewise/runtime/detail/train_skips.hpp"
#include "stagewise/runtime/fan_out.hpp"
#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/split_backward.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/runtime/transport.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/reductions.hpp"
#include "stagewise/schedule/timeline.hpp"

#include <torch/autograd.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace stagewise::runtime {

namespace detail {

// One action's cell and what it reaches: its stage, the step, the transport.
template <class Transport>
struct ActionContext {
  std::vector<std::unique_ptr<StageRuntime>>& stages;
  StageRuntime& stage;
  TrainStep& step;
  Transport& mail;
  CellMemory& cell;
  int j;  // stage
  int i;  // micro-batch
  bool last;
};

// What an action consumes from other stages, received before it starts: an F's activation and
// popped skips, a B's or I's output gradient (moved to this stage).
struct Inputs {
  std::optional<Message> activation;
  std::optional<Message> grad;
};

template <class Transport>
Inputs receive_inputs(ActionContext<Transport>& c, schedule::ActionKind kind) {
  using schedule::ActionKind;
  Inputs in;
  if (kind == ActionKind::forward) {
    if (c.j > 0) {
      in.activation = c.mail.recv({schedule::TransferKind::activation, c.j, c.i});
      if (!in.activation) throw Aborted{};
    }
    if (c.step.skips && !c.step.skips->receive(c.stages, c.j, c.i, c.mail)) throw Aborted{};
  }
  if ((kind == ActionKind::backward || kind == ActionKind::input_grad) && !c.last) {
    in.grad = c.mail.recv({schedule::TransferKind::gradient, c.j, c.i});
    if (!in.grad) throw Aborted{};
    const StageRuntime* next = c.stages[static_cast<std::size_t>(c.j + 1)].get();
    for (auto& g : in.grad->tensors) g = c.stage.take_in(g, next, static_cast<std::size_t>(c.i));
  }
  return in;
}

// F: the cell's forward; its output goes to the next stage, its skips to their popping stages.
template <class Transport>
void run_forward(ActionContext<Transport>& c, Inputs& in, torch::Tensor& total) {
  Batch x = c.step.inputs[static_cast<std::size_t>(c.i)];
  if (c.j > 0) {
    Batch received = in.activation->atomic ? Batch(std::move(in.activation->tensors.front()))
                                           : Batch(std::move(in.activation->tensors));
    x = c.stage.receive(received, c.stages[static_cast<std::size_t>(c.j - 1)].get(),
                        static_cast<std::size_t>(c.i));
  }
  Batch out = forward_cell(c.stage, c.j, c.i, c.last, std::move(x), c.step, c.cell, total);
  if (c.step.skips) c.step.skips->send(c.j, c.i, c.mail);
  if (!c.last) {
    Message sent;
    sent.atomic = out.atomic();
    sent.tensors.reserve(out.size());
    for (const auto& t : out) sent.tensors.push_back(t.detach());
    c.mail.send({schedule::TransferKind::activation, c.j + 1, c.i}, std::move(sent));
  }
}

// The roots a B or an I differentiates: the cell's outputs (or loss) with their gradients, and a
// stashing cell's stashed tensors with the gradients their popping stages sent back.
template <class Transport>
void roots_of(ActionContext<Transport>& c, Inputs& in, std::vector<torch::Tensor>& outs,
              std::vector<torch::Tensor>& grads) {
  backward_roots(c.cell, c.last, in.grad ? &in.grad->tensors : nullptr, outs, grads);
  if (c.last && c.step.loss_scale.defined() && !outs.empty()) {
    outs.front() = outs.front() * c.step.loss_scale;  // scaler.scale(loss), before its backward
    grads.front() = torch::ones_like(outs.front());
  }
  if (c.step.skips && !c.step.skips->add_roots(c.stages, c.j, c.i, outs, grads, c.mail)) {
    throw Aborted{};
  }
}

// B: the cell's whole backward; the cell's activations are freed, then its input gradients go
// to the previous stage. Freed first: once the previous stage has its gradient, this cell holds
// nothing of its output (schedule::worker_memory counts on that order).
template <class Transport>
void run_backward(ActionContext<Transport>& c, Inputs& in) {
  std::vector<torch::Tensor> outs;
  std::vector<torch::Tensor> grads;
  roots_of(c, in, outs, grads);
  if (!outs.empty()) torch::autograd::backward(outs, grads);
  outs.clear();
  grads.clear();
  if (c.step.skips) c.step.skips->send_grads(c.j, c.i, c.mail);
  Message input_grads;
  input_grads.atomic = c.cell.input_atomic;
  input_grads.tensors.reserve(c.cell.leaves.size());
  for (auto& leaf : c.cell.leaves) input_grads.tensors.push_back(leaf.grad());
  c.cell = CellMemory{};
  in.grad.reset();
  if (c.j > 0)
    c.mail.send({schedule::TransferKind::gradient, c.j - 1, c.i}, std::move(input_grads));
}

// I: the input gradients only, sent at once (a popping cell's skip gradients too, as it does its
// inputs'); the split keeps what W reads.
template <class Transport>
void run_input_grad(ActionContext<Transport>& c, Inputs& in) {
  std::vector<torch::Tensor> outs;
  std::vector<torch::Tensor> grads;
  roots_of(c, in, outs, grads);
  std::vector<torch::Tensor> targets = c.cell.leaves;
  const std::size_t inputs = targets.size();
  if (c.step.skips) {
    for (auto& t :
         c.step.skips->popped(static_cast<std::size_t>(c.j), static_cast<std::size_t>(c.i)))
      targets.push_back(std::move(t));
  }
  c.cell.split.emplace();
  auto input_grads = c.cell.split->input_grad(std::move(outs), std::move(grads), targets);
  targets.clear();  // the cell's inputs: they may go with the leaves, below
  if (c.step.skips) {
    const std::vector<torch::Tensor> skip_grads(input_grads.begin() + inputs, input_grads.end());
    c.step.skips->send_grads(c.j, c.i, c.mail, &skip_grads);
    input_grads.resize(inputs);
  }
  c.cell.outputs.clear();  // the split holds the graph until W
  c.cell.loss = torch::Tensor();
  // W reads only what the split keeps (a node that saved an input keeps it): the cell's inputs,
  // the previous stage's outputs, go now, unless the split keeps the whole graph until W. Before
  // the gradients leave, as in B.
  if (c.cell.split->keep() == SplitBackward::Keep::what_w_reads) c.cell.leaves.clear();
  in.grad.reset();
  if (c.j > 0) {
    c.mail.send({schedule::TransferKind::gradient, c.j - 1, c.i},
                Message{std::move(input_grads), c.cell.input_atomic});
  }
}

// W: the weight gradients the cell's I left, then the cell is freed.
template <class Transport>
void run_weight_grad(ActionContext<Transport>& c, const schedule::Action& a) {
  TORCH_CHECK(c.cell.split, "stagewise::train_step: ", schedule::to_string(a),
              " runs before its input-gradient pass; verify the schedule");
  c.cell.split->weight_grad();
  c.cell = CellMemory{};
}

// What a checkpointed cell keeps until its recompute: its inputs and the skips it popped.
template <class Transport>
std::vector<torch::Tensor*> kept_by(ActionContext<Transport>& c, const schedule::Action& a) {
  TORCH_CHECK(c.step.store, "stagewise::train_step: ", schedule::to_string(a),
              " moves a cell to a host store, but the step has none; give the pipe one with "
              "PipeOptions().offload(...)");
  TORCH_CHECK(c.cell.replay, "stagewise::train_step: ", schedule::to_string(a),
              " moves a cell that is not checkpointed; verify the plan (schedule::verify)");
  std::vector<torch::Tensor*> kept;
  for (auto& t : c.cell.leaves) kept.push_back(&t);
  if (c.step.skips) {
    for (auto* t :
         c.step.skips->popped_slots(static_cast<std::size_t>(c.j), static_cast<std::size_t>(c.i))) {
      kept.push_back(t);
    }
  }
  return kept;
}

// O: the cell's kept tensors go to the store; they leave the cell only once the store has them,
// so a store that fails loses nothing.
template <class Transport>
void run_offload(ActionContext<Transport>& c, const schedule::Action& a) {
  const auto kept = kept_by(c, a);
  std::vector<torch::Tensor> tensors;
  std::vector<char> grad;
  for (auto* t : kept) {
    tensors.push_back(t->defined() ? t->detach() : *t);
    grad.push_back(t->defined() && t->requires_grad());
  }
  c.step.store->put({c.j, c.i}, std::move(tensors));
  for (auto* t : kept) *t = torch::Tensor();
  c.cell.away_grad = std::move(grad);
}

// L: the kept tensors come back as the leaves they were (the recompute and the backward use them).
template <class Transport>
void run_reload(ActionContext<Transport>& c, const schedule::Action& a) {
  const auto kept = kept_by(c, a);
  auto back = c.step.store->take({c.j, c.i}, c.stage.device);
  TORCH_CHECK(back.size() == kept.size() && c.cell.away_grad.size() == kept.size(),
              "stagewise::train_step: ", schedule::to_string(a), " got ", back.size(),
              " tensors back from ", c.step.store->describe(), " for ", kept.size(),
              " kept ones; a store gives back what was put under the key");
  for (std::size_t k = 0; k < kept.size(); ++k) {
    *kept[k] = back[k].defined() ? back[k].requires_grad_(c.cell.away_grad[k] != 0) : back[k];
  }
  c.cell.away_grad.clear();
}

template <class Transport>
void run_action(ActionContext<Transport>& c, const schedule::Action& a, Inputs& in,
                torch::Tensor& total) {
  switch (a.kind) {
    case schedule::ActionKind::forward:
      return run_forward(c, in, total);
    case schedule::ActionKind::recompute:
      return recompute_cell(c.stage, c.j, c.i, c.last, c.step, c.cell);
    case schedule::ActionKind::backward:
      return run_backward(c, in);
    case schedule::ActionKind::input_grad:
      return run_input_grad(c, in);
    case schedule::ActionKind::weight_grad:
      return run_weight_grad(c, a);
    case schedule::ActionKind::offload:
      return run_offload(c, a);
    case schedule::ActionKind::reload:
      return run_reload(c, a);
  }
}

}  // namespace detail

/// Runs worker `w`'s actions of `plan` in order (called on that worker's thread): F takes the
/// activation from the transport and posts its output to the next stage; R recomputes a
/// checkpointed cell; B runs the cell's backward and posts its input gradients; I posts the input
/// gradients and keeps the rest for W, which accumulates the weight gradients; O moves what a
/// checkpointed cell keeps to the step's store and L brings it back. A worker may run
/// several stages (interleaved schedules). Appends each action's times to `record` if given.
/// Returns the summed loss of the micro-batches whose last stage ran here.
template <transport Transport>
torch::Tensor run_program(std::vector<std::unique_ptr<StageRuntime>>& stages,
                          const schedule::Plan& plan, int w, TrainStep& step, Transport& mail,
                          std::vector<schedule::TimedAction>* record) {
  const int n = plan.stages;
  const int m = plan.micro_batches;
  std::vector<std::vector<detail::CellMemory>> cells(static_cast<std::size_t>(n));
  torch::Tensor total;
  auto now = [&] {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - step.start)
        .count();
  };

  const auto& program = plan.programs[static_cast<std::size_t>(w)];
  // Where each stage's gradients are final here (schedule::reductions), for gradients_ready.
  std::vector<std::size_t> last_grad(step.gradients_ready ? static_cast<std::size_t>(n) : 0,
                                     program.size());
  if (step.gradients_ready) {
    const auto points = schedule::reductions(plan);  // kept: the loop reads one of its rows
    for (const auto& p : points[static_cast<std::size_t>(w)]) {
      last_grad[static_cast<std::size_t>(p.stage)] = p.after;
    }
  }
  std::vector<char> needed(step.parameters_needed ? static_cast<std::size_t>(n) : 0, 1);
  for (std::size_t k = 0; k < program.size(); ++k) {
    const auto& a = program[k];
    const int j = a.stage;
    const int i = a.micro;
    TORCH_CHECK(stages[static_cast<std::size_t>(j)] != nullptr, "stagewise::train_step: worker ", w,
                " runs stage ", j,
                " but that stage is not in this process; give run_programs "
                "every stage its local workers run");
    StageRuntime& stage = *stages[static_cast<std::size_t>(j)];
    auto& row = cells[static_cast<std::size_t>(j)];
    if (row.empty()) row.resize(static_cast<std::size_t>(m));
    detail::ActionContext<Transport> c{
        stages, stage, step, mail, row[static_cast<std::size_t>(i)], j, i, j == n - 1};
    std::optional<c10::DeviceGuard> device_guard;
    std::optional<c10::StreamGuard> stream_guard;
    if (stage.device.type() != torch::kCPU) {
      device_guard.emplace(stage.device);
      stream_guard.emplace(stage.compute);
    }
    // Wait for what the action consumes; its recorded time starts once that is here, and the
    // time spent waiting is recorded beside it (Timeline::waiting).
    const double ready = record ? now() : 0.0;
    detail::Inputs in = detail::receive_inputs(c, a.kind);
    if (!needed.empty() && needed[static_cast<std::size_t>(j)] &&
        a.kind == schedule::ActionKind::forward) {
      needed[static_cast<std::size_t>(j)] = 0;
      step.parameters_needed(j);  // after the input arrived: other work hides the wait
    }
    const double start = record ? now() : 0.0;
    // The action itself; an exception it raises gains the cell and the phase as context.
    const bool weights = step.weight_pass && (a.kind == schedule::ActionKind::backward ||
                                              a.kind == schedule::ActionKind::weight_grad);
    try {
      if (weights) step.weight_pass(j, true);
      detail::run_action(c, a, in, total);
      if (weights) step.weight_pass(j, false);
    } catch (const detail::Aborted&) {
      throw;
    } catch (const RelayedError&) {
      throw;  // another process's failure, already naming its cell
    } catch (...) {
      ::stagewise::detail::annotate_current_exception(ErrorContext{j, i, detail::phase_of(a.kind)});
      throw;
    }
    if (record) record->push_back({a, w, start, now(), start - ready});
    if (step.gradients_ready && last_grad[static_cast<std::size_t>(j)] == k) {
      step.gradients_ready(j);
    }
  }
  return total;
}

/// Runs the programs of `plan` of the workers local to this process concurrently, worker w on
/// `workers[w]` (null: a worker of another process), over `mail` (any `transport`), and returns
/// the summed, weighted loss if the last stage's worker is local (else an undefined tensor).
/// `stages[j]` may be null for a stage no local worker runs; messages to it go through the
/// transport. A failure in any local stage aborts the transport, which stops the others; the
/// first exception is rethrown unchanged. If `timeline` is given, it receives every local
/// action's start and end, in microseconds from the start of the step.
///   MailboxTransport mail(plan.stages, plan.micro_batches, skips);
///   auto loss = run_programs(stages, plan, step, mail, workers);
/// (The pipes call it from `PipeOverImpl`, pipe/pipe_over.hpp, which also rethrows the
/// transport's first error.)
template <transport Transport>
torch::Tensor run_programs(std::vector<std::unique_ptr<StageRuntime>>& stages,
                           const schedule::Plan& plan, TrainStep& step, Transport& mail,
                           std::span<Worker* const> workers,
                           schedule::Timeline* timeline = nullptr) {
  TORCH_CHECK(plan.stages == static_cast<int>(stages.size()),
              "stagewise::train_step: the plan has ", plan.stages, " stages but the pipe ",
              stages.size(), "; plan for the pipe's stages");
  TORCH_CHECK(plan.workers == static_cast<int>(workers.size()),
              "stagewise::train_step: the plan has ", plan.workers, " workers but ", workers.size(),
              " were given; give one (or null for a remote one) per plan worker");
  std::exception_ptr first;
  torch::Tensor loss;
  std::vector<std::vector<schedule::TimedAction>> records(workers.size());
  const int last_worker = plan.worker_of(plan.stages - 1);
  step.start = std::chrono::steady_clock::now();
  fan_out(workers, [&](std::size_t w) {
    try {
      auto total = run_program(stages, plan, static_cast<int>(w), step, mail,
                               timeline ? &records[w] : nullptr);
      if (static_cast<int>(w) == last_worker) loss = total;
    } catch (const detail::Aborted&) {
      // another stage failed first; its exception is the one reported
    } catch (...) {
      mail.abort(std::current_exception());
      throw;
    }
  });
  if (timeline) {
    timeline->stages = plan.stages;
    timeline->micro_batches = plan.micro_batches;
    timeline->workers = plan.workers;
    timeline->unit = "us";
    timeline->actions.clear();
    for (auto& r : records) timeline->actions.insert(timeline->actions.end(), r.begin(), r.end());
    std::stable_sort(timeline->actions.begin(), timeline->actions.end(),
                     [](const schedule::TimedAction& x, const schedule::TimedAction& y) {
                       return x.start < y.start;
                     });
  }
  return loss;
}

}  // namespace stagewise::runtime
