#pragma once

#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/runtime/transport.hpp"
#include "stagewise/skip/layout.hpp"
#include "stagewise/skip/tracker.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// From the skip layer's private code.
using ::stagewise::detail::LayerFrame;
using ::stagewise::detail::SkipLayout;

/// Skip connections in `train_step`, where every (stage, micro-batch) cell has its own graph:
/// routing over the message layer (kinds `skip` and `skip_grad`, keyed by the receiving stage,
/// the micro-batch and the skip's index in the layout).
///
/// A cross-stage skip is sent, detached, straight from the stashing stage to the popping stage,
/// where it becomes a leaf of that cell's graph (the same leaf in the forward and in the
/// recompute). After the popping cell's backward the leaf's gradient is sent back, and the
/// stashing cell's backward starts from its outputs and its stashed tensors together. Only the
/// popping stage holds the tensor in between; the stages it skips never see it. Skips within a
/// stage are kept plainly for the duration of one run of the cell.
class TrainSkips {
 public:
  TrainSkips(std::shared_ptr<const SkipLayout> layout, std::size_t stages, std::size_t micro)
      : layout_(std::move(layout)), m_(micro), cells_(stages * micro) {}

  /// The number of skips in the layout (skip messages carry an index below it).
  std::size_t num_skips() const { return layout_->routes().size(); }

  /// Forward of cell (j, i): waits for the skips routed into stage j and makes them leaves on
  /// stage j's device. `stages[k]` is null for a stage in another process. False when the step
  /// was aborted.
  template <runtime::transport Transport>
  bool receive(std::vector<std::unique_ptr<runtime::StageRuntime>>& stages, std::size_t j,
               std::size_t i, Transport& transport) {
    auto& cell = cell_at(j, i);
    for (const auto& r : layout_->copies_into(j)) {
      auto m = transport.recv(key(schedule::TransferKind::skip, j, i, *r.skip));
      if (!m) return false;
      torch::Tensor x = std::move(m->tensors.front());
      if (x.defined()) {
        x = stages[j]->take_in(x, stages[r.stash_stage].get(), i).detach();
        x.requires_grad_(x.is_floating_point() || x.is_complex());
      }
      cell.leaves[r.skip] = std::move(x);
    }
    return true;
  }

  /// Runs `body` (the stage's function, in the forward or the recompute) with cell (j, i)'s
  /// tracker and stage j's declarations installed.
  template <class F>
  auto run(std::size_t j, std::size_t i, F&& body) {
    Cell cell_tracker(*this, j, i);
    UseSkipTracker use(cell_tracker);
    LayerFrame frame(layout_->stage(j), [j] { return "stage " + std::to_string(j); });
    auto out = body();
    frame.finish();
    return out;
  }

  /// After the forward of cell (j, i): sends the stashed tensors to their popping stages. A
  /// stashed tensor without graph (a checkpointed forward) is not kept: the recompute stashes
  /// it again with its graph.
  template <runtime::transport Transport>
  void send(std::size_t j, std::size_t i, Transport& transport) {
    auto& cell = cell_at(j, i);
    for (const auto& r : layout_->copies_from(j)) {
      auto it = cell.stashed.find(r.skip);
      torch::Tensor t = it == cell.stashed.end() ? torch::Tensor() : it->second;
      transport.send(key(schedule::TransferKind::skip, r.pop_stage, i, *r.skip),
                     runtime::Message{{t.defined() ? t.detach() : t}});
      if (it != cell.stashed.end() && !(t.defined() && t.requires_grad())) cell.stashed.erase(it);
    }
  }

  /// Before the backward of cell (j, i): adds each stashed tensor and the gradient its popping
  /// stage sent back (moved to stage j's device) to the roots of the backward. False when the
  /// step was aborted.
  template <runtime::transport Transport>
  bool add_roots(std::vector<std::unique_ptr<runtime::StageRuntime>>& stages, std::size_t j,
                 std::size_t i, std::vector<torch::Tensor>& roots,
                 std::vector<torch::Tensor>& grads, Transport& transport) {
    auto& cell = cell_at(j, i);
    for (const auto& r : layout_->copies_from(j)) {
      auto m = transport.recv(key(schedule::TransferKind::skip_grad, j, i, *r.skip));
      if (!m) return false;
      const torch::Tensor& g = m->tensors.front();
      auto it = cell.stashed.find(r.skip);
      if (it == cell.stashed.end() || !g.defined()) continue;  // no gradient: nothing to add
      const torch::Tensor& t = it->second;
      if (!t.defined() || !t.requires_grad()) continue;
      roots.push_back(t);
      grads.push_back(stages[j]->take_in(g, stages[r.pop_stage].get(), i));
    }
    return true;
  }

  /// The skips popped by cell (j, i), as the leaves of its graph, in the order `send_grads`
  /// takes their gradients (undefined for a skip that did not arrive or was None). A split
  /// backward's I asks for their gradients beside the stage inputs'.
  std::vector<torch::Tensor> popped(std::size_t j, std::size_t i) {
    auto& cell = cell_at(j, i);
    std::vector<torch::Tensor> out;
    for (const auto& r : layout_->copies_into(j)) {
      auto it = cell.leaves.find(r.skip);
      out.push_back(it == cell.leaves.end() ? torch::Tensor() : it->second);
    }
    return out;
  }

  /// Where the skips popped by cell (j, i) are kept until its backward (those that arrived), for
  /// an offload O to move them to a host store and its reload L to put them back.
  std::vector<torch::Tensor*> popped_slots(std::size_t j, std::size_t i) {
    auto& cell = cell_at(j, i);
    std::vector<torch::Tensor*> out;
    for (const auto& r : layout_->copies_into(j)) {
      auto it = cell.leaves.find(r.skip);
      if (it != cell.leaves.end()) out.push_back(&it->second);
    }
    return out;
  }

  /// After the backward (B, or I) of cell (j, i): sends the popped leaves' gradients back to
  /// their stashing stages and frees the cell's skips. The gradients are the leaves' `.grad`
  /// after a B; after an I, which accumulates nothing, give them as `given` (in `popped`'s
  /// order), so the stashing stage's backward can start whether its consumer ran B or I then W.
  template <runtime::transport Transport>
  void send_grads(std::size_t j, std::size_t i, Transport& transport,
                  const std::vector<torch::Tensor>* given = nullptr) {
    auto& cell = cell_at(j, i);
    std::size_t k = 0;
    for (const auto& r : layout_->copies_into(j)) {
      auto it = cell.leaves.find(r.skip);
      torch::Tensor g;
      if (given) {
        if (k < given->size()) g = (*given)[k];
        ++k;
      } else if (it != cell.leaves.end() && it->second.defined() && it->second.requires_grad()) {
        g = it->second.grad();
      }
      transport.send(key(schedule::TransferKind::skip_grad, r.stash_stage, i, *r.skip),
                     runtime::Message{{std::move(g)}});
    }
    cell = CellState{};
  }

 private:
  runtime::MessageKey key(schedule::TransferKind kind, std::size_t stage, std::size_t i,
                          const SkipInfo& skip) const {
    return {kind, static_cast<int>(stage), static_cast<int>(i),
            static_cast<int>(layout_->index_of(skip))};
  }

  struct CellState {
    std::map<const SkipInfo*, torch::Tensor> leaves;   // popped, as leaves of this cell's graph
    std::map<const SkipInfo*, torch::Tensor> stashed;  // cross-stage stashes, with their graph
    SkipTracker within;                                // skips that stay in the stage
  };

  // The tracker installed while a cell runs.
  class Cell final : public SkipTrackerBase {
   public:
    Cell(TrainSkips& owner, std::size_t j, std::size_t i)
        : owner_(owner), state_(owner.cell_at(j, i)) {}
    void stash(const SkipInfo& skip, torch::Tensor tensor) override {
      if (owner_.layout_->requires_copy(skip)) {
        state_.stashed[&skip] = std::move(tensor);
      } else {
        state_.within.stash(skip, std::move(tensor));
      }
    }
    torch::Tensor pop(const SkipInfo& skip) override {
      if (!owner_.layout_->requires_copy(skip)) return state_.within.pop(skip);
      auto it = state_.leaves.find(&skip);
      TORCH_CHECK(it != state_.leaves.end(), "stagewise::pop: skip ", skip.describe(),
                  " did not arrive at this stage. Stash it in an earlier stage.");
      return it->second;
    }

   private:
    TrainSkips& owner_;
    CellState& state_;
  };

  CellState& cell_at(std::size_t j, std::size_t i) { return cells_.at(j * m_ + i); }

  std::shared_ptr<const SkipLayout> layout_;
  std::size_t m_;
  std::vector<CellState> cells_;  // stage-major; each touched only by its stage's worker
};

}  // namespace stagewise::runtime::detail
