#pragma once

// Internals of stagewise::parallel_branches: the autograd node that joins the branches' graphs to
// the caller's and runs their backwards (CPU branches on a pool, branches on a device on the
// node's own thread), and the forward runner that builds them (on streams of their own on CUDA).

#include "stagewise/core/autocast_state.hpp"
#include "stagewise/runtime/stream.hpp"
#include "stagewise/threads/thread_pool.hpp"
#include "stagewise/threads/thread_state.hpp"

#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

namespace stagewise::detail {

using torch::autograd::variable_list;

// A branch: its input tensors in, its output tensors out (public name: stagewise::Branch).
using BranchFn = std::function<variable_list(const variable_list&)>;

// The streams one branch runs on: one per CUDA device its inputs or outputs are on (empty for a
// branch on the CPU). The first is its home stream, whose device is current while it runs.
using BranchStreams = std::vector<c10::Stream>;

// The stream of `streams` on `device`, or null.
inline const c10::Stream* stream_on(const BranchStreams& streams, const c10::Device& device) {
  for (const auto& stream : streams) {
    if (stream.device() == device) return &stream;
  }
  return nullptr;
}

// Everything the backward needs, shared by the forward call and the autograd node (which holds it
// in its context as a capsule, so it dies with the node if backward never comes).
struct BranchesState : torch::CustomClassHolder {
  std::shared_ptr<ThreadPool> pool;
  std::vector<variable_list> leaves;   // per branch: the detached inputs its graph starts from
  std::vector<variable_list> outputs;  // per branch: its outputs, which hold its graph
  // Position of each defined input / output in the node's flat lists; -1 for undefined ones.
  std::vector<std::vector<std::int64_t>> input_slot;
  std::vector<std::vector<std::int64_t>> output_slot;
  std::vector<BranchStreams> streams;  // per branch: the streams its forward ran on
  // Per branch: its backward runs on the node's thread, not on the pool (its graph reaches a
  // device other than the CPU, whose backward work autograd runs on that device's thread).
  std::vector<char> inline_backward;
  bool on_device = false;  // some branch's backward runs inline (read by an enclosing branch)
  bool released = false;

  void release() {
    leaves.clear();
    outputs.clear();
    released = true;
  }
};

// True if autograd runs `node` on a device's thread: it receives a gradient on a device other
// than the CPU.
inline bool runs_on_device(const torch::autograd::Node& node) {
  for (std::uint32_t k = 0; k < node.num_inputs(); ++k) {
    if (!node.input_metadata(k).device().is_cpu()) return true;
  }
  return false;
}

// True if `node` is the node of a parallel_branches call whose branches' backwards run on device
// threads (their graphs hang off that node's state, out of reach of a walk along its edges).
inline bool hides_device_work(const torch::autograd::Node& node);

// Fails if the graph a branch recorded reaches a node that the branch did not record: the branch
// used a tensor from the surrounding graph that it did not get as an input, and its backward (on a
// pool thread) would run into the surrounding graph, concurrently with the caller's backward.
// A node belongs to the branch if it was recorded on this thread (`thread`) at or after the
// branch started (sequence numbers count up per thread). Leaves' accumulators, marked with
// sequence number UINT64_MAX, end the walk. Returns whether any node of the graph (accumulators
// included) runs on a device's thread in backward.
inline bool check_self_contained(const variable_list& outputs, std::uint64_t thread,
                                 std::uint64_t first, std::size_t branch) {
  std::vector<torch::autograd::Node*> pending;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& out : outputs) {
    if (out.defined() && out.grad_fn()) pending.push_back(out.grad_fn().get());
  }
  bool on_device = false;
  while (!pending.empty()) {
    auto* node = pending.back();
    pending.pop_back();
    if (!seen.insert(node).second) continue;
    on_device = on_device || runs_on_device(*node) || hides_device_work(*node);
    if (node->sequence_nr() == UINT64_MAX) continue;
    TORCH_CHECK(node->thread_id() == thread && node->sequence_nr() >= first,
                "stagewise::parallel_branches: branch ", branch,
                " differentiates through a tensor computed outside the branch (its graph reaches ",
                node->name(),
                ", recorded before the branch ran or on another thread). Pass that "
                "tensor to the branch as one of its inputs, or detach() it if it needs no "
                "gradient.");
    for (const auto& edge : node->next_edges()) {
      if (edge.function) pending.push_back(edge.function.get());
    }
  }
  return on_device;
}

// True if a branch's inputs hold no element at all (each defined one has a zero dimension, e.g. no
// rows) and there is at least one.
inline bool all_empty(const variable_list& inputs) {
  bool any = false;
  for (const auto& input : inputs) {
    if (!input.defined()) continue;
    if (input.numel() != 0) return false;
    any = true;
  }
  return any;
}

// Gives every branch with inputs on CUDA a stream of its own from the device's pool, one per
// device of its inputs, that first waits for the caller's current stream there (which produced
// the inputs); the inputs are recorded on it, so that the caching allocator does not hand their
// memory out again while the branch may still read it.
inline std::vector<BranchStreams> branch_streams(const std::vector<variable_list>& inputs) {
  std::vector<BranchStreams> streams(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    for (const auto& input : inputs[i]) {
      if (!input.defined() || !input.is_cuda()) continue;
      const auto* stream = stream_on(streams[i], input.device());
      if (!stream) {
        streams[i].push_back(runtime::new_stream(input.device()));
        stream = &streams[i].back();
        runtime::wait_stream(*stream, runtime::current_stream(input.device()));
      }
      runtime::record_stream(input, *stream);
    }
  }
  return streams;
}

// Runs every branch's forward on the pool, each on its streams (see branch_streams), and hands
// the outputs back ready for the caller's current streams. With `state`, each branch starts from
// leaf copies of its inputs (recorded in `state->leaves`) so that the branches' graphs are
// disjoint, and the state learns which branches' backwards must run inline.
inline std::vector<variable_list> run_forwards(const std::vector<BranchFn>& branches,
                                               const std::vector<variable_list>& inputs,
                                               ThreadPool& pool, BranchesState* state) {
  const ThreadState caller;
  std::vector<variable_list> outputs(branches.size());
  auto streams = branch_streams(inputs);
  std::vector<char> on_device(branches.size());
  if (state) state->leaves.assign(branches.size(), {});
  pool.run(branches.size(), [&](std::size_t i) {
    ThreadStateGuard guard(caller);
    {
      // The home stream's device is current, as under a c10::StreamGuard; the branch's streams
      // are the current ones of their devices.
      c10::OptionalDeviceGuard device;
      if (!streams[i].empty()) device.reset_device(streams[i].front().device());
      c10::MultiStreamGuard on_streams(streams[i]);
      if (!state) {
        outputs[i] = branches[i](inputs[i]);
      } else {
        variable_list leaves;
        leaves.reserve(inputs[i].size());
        for (const auto& input : inputs[i]) {
          if (!input.defined()) {
            leaves.emplace_back();
            continue;
          }
          auto leaf = input.detach();
          if (input.requires_grad()) leaf.requires_grad_(true);
          leaves.push_back(std::move(leaf));
        }
        // A cached cast made outside the branch would join the branch's graph to the caller's.
        AutocastCacheOff no_cache;
        const auto thread = at::RecordFunction::currentThreadId();
        const auto first = at::sequence_number::peek();
        if (all_empty(inputs[i])) {
          // Nothing to compute (an expert that got no tokens): run it for its output shapes only,
          // recording no graph, so its parameters get no gradient, as when a loop skips it.
          torch::NoGradGuard no_grad;
          outputs[i] = branches[i](leaves);
        } else {
          outputs[i] = branches[i](leaves);
        }
        on_device[i] = check_self_contained(outputs[i], thread, first, i);
        state->leaves[i] = std::move(leaves);
      }
    }
    // Outputs on a CUDA device that no input was on were made on this thread's current stream
    // there; the caller's stream waits for that one too.
    for (const auto& out : outputs[i]) {
      if (out.defined() && out.is_cuda() && !stream_on(streams[i], out.device())) {
        streams[i].push_back(runtime::current_stream(out.device()));
      }
    }
  });
  // The caller's current streams wait for the branches' work; the outputs are recorded on them,
  // as the caller now uses memory that the branches' streams allocated.
  for (std::size_t i = 0; i < branches.size(); ++i) {
    for (const auto& stream : streams[i]) {
      runtime::wait_stream(runtime::current_stream(stream.device()), stream);
    }
    for (const auto& out : outputs[i]) {
      if (out.defined() && out.is_cuda()) {
        runtime::record_stream(out, runtime::current_stream(out.device()));
      }
    }
  }
  if (state) {
    state->inline_backward.resize(branches.size());
    for (std::size_t i = 0; i < branches.size(); ++i) {
      state->inline_backward[i] = on_device[i] || !streams[i].empty();
      state->on_device = state->on_device || state->inline_backward[i];
    }
    state->streams = std::move(streams);
  }
  return outputs;
}

// Runs one branch's backward for the gradients that reached the node; fills `input_grads` (flat).
inline void run_backward(BranchesState& state, std::size_t i, const variable_list& grads,
                         const std::vector<char>& needed, bool keep_graph, bool accumulate,
                         variable_list& input_grads) {
  variable_list roots;
  variable_list root_grads;
  for (std::size_t j = 0; j < state.outputs[i].size(); ++j) {
    const auto slot = state.output_slot[i][j];
    if (slot < 0 || !grads[slot].defined() || !state.outputs[i][j].requires_grad()) continue;
    roots.push_back(state.outputs[i][j]);
    root_grads.push_back(grads[slot]);
  }
  if (roots.empty()) return;
  auto& leaves = state.leaves[i];
  if (accumulate) {
    // A plain backward: parameters inside the branch accumulate their .grad like the leaves do.
    torch::autograd::backward(roots, root_grads, keep_graph, /*create_graph=*/false);
    for (std::size_t k = 0; k < leaves.size(); ++k) {
      const auto slot = state.input_slot[i][k];
      if (slot < 0 || !leaves[k].requires_grad()) continue;
      input_grads[slot] = leaves[k].grad();
      leaves[k].mutable_grad().reset();  // a retained graph may see another backward
    }
    return;
  }
  // torch::autograd::grad or backward(inputs=...): only the needed inputs, nothing accumulated.
  variable_list wanted;
  std::vector<std::int64_t> wanted_slots;
  for (std::size_t k = 0; k < leaves.size(); ++k) {
    const auto slot = state.input_slot[i][k];
    if (slot < 0 || !needed[slot] || !leaves[k].requires_grad()) continue;
    wanted.push_back(leaves[k]);
    wanted_slots.push_back(slot);
  }
  if (wanted.empty()) return;
  auto got = torch::autograd::grad(roots, wanted, root_grads, keep_graph, /*create_graph=*/false,
                                   /*allow_unused=*/true);
  for (std::size_t k = 0; k < got.size(); ++k) input_grads[wanted_slots[k]] = got[k];
}

// Runs one branch's backward on this thread (a re-entrant backward when this is autograd's
// thread for a device: the branch's graph then runs here too, see the node's backward). Its
// kernels go to the streams its forward ran on; those first wait for this thread's current
// streams, on which the engine made the incoming gradients ready, and the current streams then
// wait for them, so the input gradients are ready where the engine expects the node's outputs.
inline void run_backward_inline(BranchesState& state, std::size_t i, const variable_list& grads,
                                const std::vector<char>& needed, bool keep_graph, bool accumulate,
                                variable_list& input_grads) {
  const auto& streams = state.streams[i];
  for (const auto& stream : streams) {
    runtime::wait_stream(stream, runtime::current_stream(stream.device()));
  }
  for (auto slot : state.output_slot[i]) {
    if (slot < 0 || !grads[slot].defined() || !grads[slot].is_cuda()) continue;
    if (const auto* stream = stream_on(streams, grads[slot].device())) {
      runtime::record_stream(grads[slot], *stream);
    }
  }
  auto rejoin = [&] {
    for (const auto& stream : streams) {
      runtime::wait_stream(runtime::current_stream(stream.device()), stream);
    }
  };
  try {
    run_backward(state, i, grads, needed, keep_graph, accumulate, input_grads);
  } catch (...) {
    rejoin();
    throw;
  }
  rejoin();
  for (auto slot : state.input_slot[i]) {
    if (slot < 0 || !input_grads[slot].defined() || !input_grads[slot].is_cuda()) continue;
    runtime::record_stream(input_grads[slot],
                           runtime::current_stream(input_grads[slot].device()));
  }
}

// The node that joins the branches' graphs to the surrounding graph. Its forward only hands out
// the outputs the branches already computed; its backward runs the branches' backwards.
//
// Where: autograd runs a node whose incoming gradients are on a CUDA device on its one thread for
// that device, and sends every CUDA node of a graph there. A branch on CUDA run on the pool would
// queue its backward to that thread while this node blocks it waiting for the pool: a deadlock.
// So branches whose graphs reach a device run here, one after another: a backward called from
// inside a node's backward is re-entrant and runs its graph on the calling engine thread (CPU
// nodes included), so nothing waits for a blocked thread; their kernels still overlap on the GPU,
// each branch's on its own streams. Then the CPU-only branches run on the pool, as before: their
// graphs need no engine thread, so the wait for them cannot deadlock either.
struct ParallelBranchesFunction : torch::autograd::Function<ParallelBranchesFunction> {
  static variable_list forward(torch::autograd::AutogradContext* ctx,
                               c10::intrusive_ptr<BranchesState> state,
                               at::TensorList /*flat_inputs*/, const torch::Tensor& /*phony*/) {
    ctx->set_materialize_grads(false);
    variable_list flat;
    variable_list constant;
    for (std::size_t i = 0; i < state->outputs.size(); ++i) {
      for (std::size_t j = 0; j < state->outputs[i].size(); ++j) {
        if (state->output_slot[i][j] < 0) continue;
        const auto& out = state->outputs[i][j];
        flat.push_back(out.detach());
        if (!out.requires_grad()) constant.push_back(flat.back());
      }
    }
    ctx->mark_non_differentiable(constant);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return flat;
  }

  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(),
                "stagewise::parallel_branches: double backward (create_graph=true) is not "
                "supported. Call backward without create_graph, or run the branches one after "
                "another (a plain loop) where you need higher-order gradients.");
    auto state =
        c10::static_intrusive_pointer_cast<BranchesState>(ctx->saved_data["state"].toCapsule());
    TORCH_CHECK(!state->released,
                "stagewise::parallel_branches: backward through the branches a second time, but "
                "their graphs were freed by the first backward. Pass retain_graph=true to the "
                "first backward (as for any graph) if you need to backward twice.");
    std::size_t flat_inputs = 0;
    for (const auto& slots : state->input_slot) {
      for (auto slot : slots) flat_inputs += slot >= 0 ? 1 : 0;
    }
    std::vector<char> needed(flat_inputs);
    for (std::size_t k = 0; k < flat_inputs; ++k) needed[k] = ctx->needs_input_grad(k);
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    const bool accumulate = exec_info == nullptr || exec_info->empty();

    variable_list input_grads(flat_inputs);
    std::exception_ptr error;
    std::vector<std::size_t> pooled;
    for (std::size_t i = 0; i < state->outputs.size(); ++i) {
      if (!state->inline_backward[i]) {
        pooled.push_back(i);
        continue;
      }
      try {
        run_backward_inline(*state, i, grads, needed, keep_graph, accumulate, input_grads);
      } catch (...) {
        error = std::current_exception();  // the branches not yet run are skipped
        break;
      }
    }
    if (!error && !pooled.empty()) {
      const ThreadState caller;
      try {
        state->pool->run(pooled.size(), [&](std::size_t k) {
          ThreadStateGuard guard(caller);
          run_backward(*state, pooled[k], grads, needed, keep_graph, accumulate, input_grads);
        });
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (!keep_graph) state->release();
    if (error) std::rethrow_exception(error);

    variable_list result;
    result.reserve(flat_inputs + 2);
    result.emplace_back();  // the state argument
    for (auto& grad : input_grads) result.push_back(std::move(grad));
    result.emplace_back();  // the phony
    return result;
  }
};

inline bool hides_device_work(const torch::autograd::Node& node) {
  const auto* inner =
      dynamic_cast<const torch::autograd::CppNode<ParallelBranchesFunction>*>(&node);
  if (inner == nullptr) return false;
  const auto it = inner->ctx_.saved_data.find("state");
  if (it == inner->ctx_.saved_data.end()) return false;
  return c10::static_intrusive_pointer_cast<BranchesState>(it->second.toCapsule())->on_device;
}

}  // namespace stagewise::detail
