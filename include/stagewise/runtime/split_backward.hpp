#pragma once

#include <torch/autograd.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <atomic>
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

// Frees its node's saved tensors as soon as the node has run in I, as a backward without
// retain_graph does: the node lies on the input-gradient path only, and nothing runs it again.
class ReleaseAfterRun final : public torch::autograd::FunctionPostHook {
 public:
  explicit ReleaseAfterRun(torch::autograd::Node* node) : node_(node) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    node_->release_variables();
    return outputs;
  }

 private:
  torch::autograd::Node* node_;  // the node that owns this hook
};

// Where the weight-gradient pass starts: the outputs whose graph leads only to parameters (with
// `root_grads`), or a node on the input-gradient path with parameter-only branches (with the
// gradients `captured` there during I, and the indices of its edges towards the inputs, `cut`).
struct WeightPart {
  torch::autograd::edge_list roots;
  torch::autograd::variable_list root_grads;
  std::shared_ptr<CapturedGrads> captured;
  std::vector<std::size_t> cut;
};

}  // namespace detail

/// One cell's backward in two passes, zero-bubble's I and W.
///
/// `input_grad` computes the gradients of the cell's inputs only: autograd skips the branches
/// that lead only to parameters. Before it runs, the graph is searched for the nodes where such
/// branches leave the input-gradient path (a Linear's addmm: one branch to its input, one to its
/// weight), and each of those nodes keeps the gradient it receives during I. `weight_grad` then
/// cuts those nodes' edges towards the inputs and runs the engine once from the kept gradients,
/// so only the skipped branches run and accumulate into the parameters' `.grad`: I + W do the
/// work of one backward, nothing twice. A parameter reached from several places (a module
/// applied twice) gets the sum, as in one backward. The graph is consumed by W. Between I and W
/// the cell keeps what W reads (`Keep::what_w_reads`, the default): after I, every node that W
/// will not run again (the input-gradient path's own nodes: a ReLU's or GELU's saved tensor,
/// attention's probabilities, the outputs themselves) releases its saved tensors as soon as it
/// has run, as a backward without retain_graph does; the nodes where W starts (a Linear's addmm: its input) and the
/// branches below them keep theirs, beside the gradients kept for W. `Keep::whole_graph` keeps
/// every saved tensor until W (what stagewise did before; for measuring what the release saves).
///   SplitBackward split;
///   auto dx = split.input_grad({y}, {dy}, {x});   // I: send dx to the previous stage
///   split.weight_grad();                          // W: later, parameters' .grad
class SplitBackward {
 public:
  /// What a cell keeps between its I and its W.
  enum class Keep {
    what_w_reads,  ///< W's starting nodes and branches, and the gradients kept for them
    whole_graph,   ///< every saved tensor of the graph (the behaviour before issue 44)
  };

  /// A split that keeps `keep` between I and W (by default the process-wide `default_keep()`).
  ///   SplitBackward split(SplitBackward::Keep::whole_graph);
  explicit SplitBackward(Keep keep = default_keep()) : keep_(keep) {}

  /// What this split keeps between I and W.
  Keep keep() const { return keep_; }

  /// What SplitBackward keeps when made without saying: `Keep::what_w_reads` unless set otherwise
  /// with `set_default_keep` (the pipes' executors make theirs that way).
  static Keep default_keep() { return default_keep_slot().load(std::memory_order_relaxed); }

  /// Sets what SplitBackward objects made from now on keep by default, process-wide; returns the
  /// previous default. Meant for benchmarks and diagnostics: set it while no step runs.
  ///   auto old = SplitBackward::set_default_keep(SplitBackward::Keep::whole_graph);
  static Keep set_default_keep(Keep keep) {
    return default_keep_slot().exchange(keep, std::memory_order_relaxed);
  }

  /// I: the gradients of `inputs` (undefined where an input gets none, or is undefined) for
  /// `outputs` with
  /// gradients `grads`; keeps what `weight_grad` needs. Outputs that do not require grad or get
  /// an undefined gradient are skipped.
  std::vector<torch::Tensor> input_grad(std::vector<torch::Tensor> outputs,
                                        std::vector<torch::Tensor> grads,
                                        const std::vector<torch::Tensor>& inputs) {
    for (std::size_t k = 0; k < outputs.size() && k < grads.size(); ++k) {
      if (outputs[k].requires_grad() && grads[k].defined()) {
        outputs_.push_back(std::move(outputs[k]));
        grads_.push_back(std::move(grads[k]));
      }
    }
    analyse(inputs);
    if (keep_ == Keep::what_w_reads) {
      for (auto& node : input_only_)
        node->add_post_hook(std::make_unique<detail::ReleaseAfterRun>(node.get()));
    }
    std::vector<torch::Tensor> wanted;
    std::vector<std::size_t> at;
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      if (inputs[k].defined() && inputs[k].requires_grad()) {
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
    if (keep_ == Keep::what_w_reads) {
      // W starts from the kept gradients and the parts' roots: the outputs, their gradients and
      // the nodes only I runs (those I did not reach too) hold nothing W reads.
      for (auto& node : input_only_) node->release_variables();
      outputs_.clear();
      grads_.clear();
    }
    input_only_.clear();
    return out;
  }

  /// W: accumulates the weight gradients into the parameters' `.grad`, then frees the graph.
  void weight_grad() {
    torch::autograd::edge_list roots;
    torch::autograd::variable_list grads;
    for (auto& part : parts_) {
      const auto& given = part.captured ? part.captured->grads : part.root_grads;
      for (std::size_t k = 0; k < part.roots.size() && k < given.size(); ++k) {
        if (!given[k].defined()) continue;
        roots.push_back(part.roots[k]);
        grads.push_back(given[k]);
      }
      // Cut the node off the input-gradient path: I has done that part, and through it this
      // node's gradient would reach the next such node's parameters a second time. (Removing
      // an edge keeps autograd's parent-above-child ordering, so the edge list is edited
      // directly; set_next_edge refuses nodes that have parents.)
      for (std::size_t e : part.cut) part.roots.front().function->next_edges()[e] = Edge();
    }
    if (!roots.empty()) {
      torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                            /*create_graph=*/false,
                                                            /*accumulate_grad=*/true);
    }
    *this = SplitBackward{keep_};
  }

 private:
  using Node = torch::autograd::Node;
  using Edge = torch::autograd::Edge;

  struct Info {
    std::shared_ptr<Node> node;
    std::vector<std::size_t> children;
    int leaf = 0;                 // 1: accumulator of an input, 2: of a parameter
    bool reaches_input = false;   // run by the input-gradient pass
    bool reaches_weight = false;  // a parameter's accumulator lies below
  };

  // The cell's graph from its outputs down: every node once, with its children.
  struct Graph {
    std::vector<Info> nodes;
    std::unordered_map<Node*, std::size_t> index;
    std::vector<Edge> root_edges;      // one per output
    std::vector<std::size_t> root_ids;  // the outputs' nodes
  };

  void analyse(const std::vector<torch::Tensor>& inputs) {
    Graph g = walk(inputs);
    mark(g);
    plan_parts(g);
  }

  Graph walk(const std::vector<torch::Tensor>& inputs) const {
    std::unordered_set<const c10::TensorImpl*> input_set;
    for (const auto& x : inputs) {
      if (x.defined() && x.requires_grad()) input_set.insert(x.unsafeGetTensorImpl());
    }
    Graph g;
    std::vector<std::size_t> todo;
    auto visit = [&](const std::shared_ptr<Node>& n) {
      auto [it, fresh] = g.index.emplace(n.get(), g.nodes.size());
      if (fresh) {
        Info info;
        info.node = n;
        if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n.get())) {
          info.leaf = input_set.count(acc->variable.unsafeGetTensorImpl()) ? 1 : 2;
        }
        g.nodes.push_back(std::move(info));
        todo.push_back(it->second);
      }
      return it->second;
    };
    for (const auto& y : outputs_) {
      g.root_edges.push_back(torch::autograd::impl::gradient_edge(y));
      g.root_ids.push_back(visit(g.root_edges.back().function));
    }
    while (!todo.empty()) {
      const std::size_t id = todo.back();
      todo.pop_back();
      const auto node = g.nodes[id].node;
      for (const auto& e : node->next_edges()) {
        if (e.is_valid()) {
          const std::size_t child = visit(e.function);
          g.nodes[id].children.push_back(child);
        }
      }
    }
    return g;
  }

  // What lies below each node (an input's accumulator, a parameter's), children first.
  void mark(Graph& g) {
    auto& nodes = g.nodes;
    std::vector<char> state(nodes.size(), 0);
    for (std::size_t r : g.root_ids) {
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
        auto& info = nodes[id];
        info.reaches_input = info.leaf == 1;
        info.reaches_weight = info.leaf == 2;
        for (std::size_t c : info.children) {
          info.reaches_input = info.reaches_input || nodes[c].reaches_input;
          info.reaches_weight = info.reaches_weight || nodes[c].reaches_weight;
        }
        reaches_inputs_ = reaches_inputs_ || info.reaches_input;
        stack.pop_back();
      }
    }
  }

  // Where W starts, and the nodes only I runs.
  void plan_parts(const Graph& g) {
    const auto& nodes = g.nodes;
    // The outputs' own parameter-only graphs (all of the graph when no input needs a gradient).
    {
      detail::WeightPart part;
      for (std::size_t k = 0; k < g.root_ids.size(); ++k) {
        const auto& info = nodes[g.root_ids[k]];
        if (info.reaches_input || !info.reaches_weight) continue;
        part.roots.push_back(g.root_edges[k]);
        part.root_grads.push_back(grads_[k]);
      }
      if (!part.roots.empty()) parts_.push_back(std::move(part));
    }
    // Nodes on the input-gradient path with parameter-only branches keep what I gives them.
    std::unordered_set<const Node*> starts;
    for (const auto& info : nodes) {
      if (!info.reaches_input || info.leaf != 0 || info.node->num_inputs() == 0) continue;
      bool branches = false;
      for (std::size_t c : info.children)
        branches = branches || (!nodes[c].reaches_input && nodes[c].reaches_weight);
      if (!branches) continue;
      detail::WeightPart part;
      for (uint32_t k = 0; k < info.node->num_inputs(); ++k) part.roots.emplace_back(info.node, k);
      const auto& edges = info.node->next_edges();
      for (std::size_t e = 0; e < edges.size(); ++e) {
        if (edges[e].is_valid() && nodes[g.index.at(edges[e].function.get())].reaches_input) {
          part.cut.push_back(e);
        }
      }
      part.captured = std::make_shared<detail::CapturedGrads>();
      part.captured->armed = true;
      info.node->add_pre_hook(std::make_unique<detail::CaptureGrads>(part.captured));
      parts_.push_back(std::move(part));
      starts.insert(info.node.get());
    }
    // The nodes only I runs: on the input-gradient path, not where W starts. Every node W runs
    // is such a start or lies below one on a parameter-only branch (which reaches no input).
    for (const auto& info : nodes) {
      if (info.reaches_input && info.leaf == 0 && !starts.count(info.node.get()))
        input_only_.push_back(info.node);
    }
  }

  static std::atomic<Keep>& default_keep_slot() {
    static std::atomic<Keep> keep{Keep::what_w_reads};
    return keep;
  }

  std::vector<torch::Tensor> outputs_;
  std::vector<torch::Tensor> grads_;
  std::vector<detail::WeightPart> parts_;
  std::vector<std::shared_ptr<Node>> input_only_;  // from analyse to the end of I
  bool reaches_inputs_ = false;
  Keep keep_ = Keep::what_w_reads;
};

}  // namespace stagewise::runtime
