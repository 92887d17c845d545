#pragma once

#include <torch/autograd.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace stagewise::runtime {

namespace detail {

// What a node of the graph received during the input-gradient pass.
struct CapturedGrads {
  bool armed = false;
  torch::autograd::variable_list grads;
};

// Keeps the gradients a node receives while armed, for the weight-gradient pass to start from.
class CaptureGrads final : public torch::autograd::FunctionPreHook {
 public:
  explicit CaptureGrads(std::shared_ptr<CapturedGrads> slot) : slot_(std::move(slot)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (slot_->armed) slot_->grads = grads;
    return grads;
  }

 private:
  std::shared_ptr<CapturedGrads> slot_;
};

// One piece of the weight-gradient pass: from `roots` (given `root_grads`, or what `captured`
// kept) down to the parameters' gradient accumulators `weights`.
struct WeightPart {
  torch::autograd::edge_list roots;
  torch::autograd::variable_list root_grads;
  std::shared_ptr<CapturedGrads> captured;
  torch::autograd::edge_list weights;
};

}  // namespace detail

/// One cell's backward in two passes, zero-bubble's I and W.
///
/// `input_grad` computes the gradients of the cell's inputs only: autograd skips the branches
/// that lead only to parameters. Before it runs, the graph is split where those branches leave
/// the input-gradient path, and every node at such a split keeps the gradient it receives.
/// `weight_grad` later runs just the skipped branches from those kept gradients and accumulates
/// into the parameters' `.grad`, so I + W do the work of one backward and nothing twice.
///
/// When a parameter hangs below two such splits (a module applied twice in one stage, tied
/// weights), running the branches one by one would count a gradient twice; then `weight_grad`
/// runs a backward from the outputs restricted to the parameters instead, which repeats the
/// activation-gradient chain (correct, slower); `reuses_input_pass()` is false.
///   SplitBackward split;
///   auto dx = split.input_grad({y}, {dy}, {x});   // I: send dx to the previous stage
///   split.weight_grad();                          // W: later, parameters' .grad
class SplitBackward {
 public:
  /// I: the gradients of `inputs` (undefined where an input gets none) for `outputs` with
  /// gradients `grads`; keeps what `weight_grad` needs.
  std::vector<torch::Tensor> input_grad(std::vector<torch::Tensor> outputs, std::vector<torch::Tensor> grads,
                                        const std::vector<torch::Tensor>& inputs) {
    for (std::size_t k = 0; k < outputs.size() && k < grads.size(); ++k) {
      if (outputs[k].requires_grad() && grads[k].defined()) {
        outputs_.push_back(std::move(outputs[k]));
        grads_.push_back(std::move(grads[k]));
      }
    }
    analyse(inputs);
    std::vector<torch::Tensor> wanted;
    std::vector<std::size_t> at;
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      if (inputs[k].requires_grad()) {
        wanted.push_back(inputs[k]);
        at.push_back(k);
      }
    }
    std::vector<torch::Tensor> out(inputs.size());
    if (reaches_inputs_ && !wanted.empty()) {
      auto got = torch::autograd::grad(outputs_, wanted, grads_, /*retain_graph=*/true,
                                       /*create_graph=*/false, /*allow_unused=*/true);
      for (std::size_t k = 0; k < got.size(); ++k) out[at[k]] = std::move(got[k]);
    }
    for (auto& part : parts_) {
      if (part.captured) part.captured->armed = false;
    }
    return out;
  }

  /// W: accumulates the weight gradients into the parameters' `.grad`, then frees the graph.
  void weight_grad() {
    if (fallback_) {
      if (!weights_.empty()) {
        torch::autograd::backward(outputs_, grads_, /*retain_graph=*/false, /*create_graph=*/false, weights_);
      }
    } else {
      auto& engine = torch::autograd::Engine::get_default_engine();
      for (auto& part : parts_) {
        const auto& given = part.captured ? part.captured->grads : part.root_grads;
        torch::autograd::edge_list roots;
        torch::autograd::variable_list grads;
        for (std::size_t k = 0; k < part.roots.size() && k < given.size(); ++k) {
          if (!given[k].defined()) continue;
          roots.push_back(part.roots[k]);
          grads.push_back(given[k]);
        }
        if (roots.empty()) continue;
        engine.execute(roots, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true,
                       part.weights);
      }
    }
    *this = SplitBackward{};
  }

  /// Whether W starts from what I kept (true) or repeats the backward chain (see the class).
  bool reuses_input_pass() const { return !fallback_; }

 private:
  using Node = torch::autograd::Node;
  using Edge = torch::autograd::Edge;

  struct Info {
    std::shared_ptr<Node> node;
    std::vector<std::size_t> children;
    int leaf = 0;  // 1: accumulator of an input, 2: of a parameter
    bool reaches_input = false;
  };

  void analyse(const std::vector<torch::Tensor>& inputs) {
    std::unordered_set<const c10::TensorImpl*> input_set;
    for (const auto& x : inputs) {
      if (x.requires_grad()) input_set.insert(x.unsafeGetTensorImpl());
    }
    std::vector<Info> nodes;
    std::unordered_map<Node*, std::size_t> index;
    std::vector<std::size_t> todo;
    auto visit = [&](const std::shared_ptr<Node>& n) {
      auto [it, fresh] = index.emplace(n.get(), nodes.size());
      if (fresh) {
        Info info;
        info.node = n;
        if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n.get())) {
          info.leaf = input_set.count(acc->variable.unsafeGetTensorImpl()) ? 1 : 2;
        }
        nodes.push_back(std::move(info));
        todo.push_back(it->second);
      }
      return it->second;
    };
    std::vector<Edge> root_edges;
    std::vector<std::size_t> root_ids;
    for (const auto& y : outputs_) {
      root_edges.push_back(torch::autograd::impl::gradient_edge(y));
      root_ids.push_back(visit(root_edges.back().function));
    }
    while (!todo.empty()) {
      const std::size_t id = todo.back();
      todo.pop_back();
      const auto node = nodes[id].node;
      for (const auto& e : node->next_edges()) {
        if (e.is_valid()) {
          const std::size_t child = visit(e.function);
          nodes[id].children.push_back(child);
        }
      }
    }
    // Which nodes lead to an input: those run by the input-gradient pass (children first).
    std::vector<char> state(nodes.size(), 0);
    for (std::size_t r : root_ids) {
      if (state[r]) continue;
      std::vector<std::pair<std::size_t, std::size_t>> stack{{r, 0}};
      state[r] = 1;
      while (!stack.empty()) {
        const auto [id, k] = stack.back();
        if (k < nodes[id].children.size()) {
          ++stack.back().second;
          const std::size_t c = nodes[id].children[k];
          if (!state[c]) {
            state[c] = 1;
            stack.push_back({c, 0});
          }
          continue;
        }
        bool reaches = nodes[id].leaf == 1;
        for (std::size_t c : nodes[id].children) reaches = reaches || nodes[c].reaches_input;
        nodes[id].reaches_input = reaches;
        reaches_inputs_ = reaches_inputs_ || reaches;
        stack.pop_back();
      }
    }
    // The parameter accumulators below a node that does not lead to an input.
    auto weights_below = [&](std::size_t from, std::vector<char>& seen, torch::autograd::edge_list& out) {
      std::vector<std::size_t> stack{from};
      while (!stack.empty()) {
        const std::size_t id = stack.back();
        stack.pop_back();
        if (seen[id]) continue;
        seen[id] = 1;
        if (nodes[id].leaf == 2) out.emplace_back(nodes[id].node, 0);
        for (std::size_t c : nodes[id].children) stack.push_back(c);
      }
    };
    std::unordered_map<Node*, std::size_t> owner;
    auto claim = [&](const torch::autograd::edge_list& weights) {
      for (const auto& w : weights) {
        if (!owner.emplace(w.function.get(), parts_.size()).second) fallback_ = true;
      }
    };
    // The outputs' own parameter-only branches (all of them when no input needs a gradient).
    {
      detail::WeightPart part;
      std::vector<char> seen(nodes.size(), 0);
      for (std::size_t k = 0; k < root_ids.size(); ++k) {
        if (nodes[root_ids[k]].reaches_input) continue;
        part.roots.push_back(root_edges[k]);
        part.root_grads.push_back(grads_[k]);
        weights_below(root_ids[k], seen, part.weights);
      }
      if (!part.weights.empty()) {
        claim(part.weights);
        parts_.push_back(std::move(part));
      }
    }
    // Nodes on the input-gradient path whose other branches lead to parameters.
    for (std::size_t id = 0; id < nodes.size(); ++id) {
      if (!nodes[id].reaches_input || nodes[id].leaf != 0) continue;
      detail::WeightPart part;
      std::vector<char> seen(nodes.size(), 0);
      for (std::size_t c : nodes[id].children) {
        if (!nodes[c].reaches_input) weights_below(c, seen, part.weights);
      }
      const auto& node = nodes[id].node;
      if (part.weights.empty() || node->num_inputs() == 0) continue;
      for (uint32_t k = 0; k < node->num_inputs(); ++k) part.roots.emplace_back(node, k);
      part.captured = std::make_shared<detail::CapturedGrads>();
      claim(part.weights);
      parts_.push_back(std::move(part));
    }
    for (const auto& info : nodes) {
      if (info.leaf == 2) {
        weights_.push_back(static_cast<torch::autograd::AccumulateGrad*>(info.node.get())->variable);
      }
    }
    if (fallback_) return;
    for (auto& part : parts_) {
      if (!part.captured) continue;
      part.captured->armed = true;
      part.roots.front().function->add_pre_hook(std::make_unique<detail::CaptureGrads>(part.captured));
    }
  }

  std::vector<torch::Tensor> outputs_;
  std::vector<torch::Tensor> grads_;
  std::vector<detail::WeightPart> parts_;
  std::vector<torch::Tensor> weights_;
  bool reaches_inputs_ = false;
  bool fallback_ = false;
};

}  // namespace stagewise::runtime
