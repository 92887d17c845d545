#include "stagewise/runtime/split_backward.hpp"

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

using stagewise::runtime::SplitBackward;

namespace {

// Identity whose backward counts its calls: marks the input-gradient path.
struct Counted : torch::autograd::Function<Counted> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, int* calls) {
    ctx->saved_data["calls"] = reinterpret_cast<int64_t>(calls);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    ++*reinterpret_cast<int*>(ctx->saved_data["calls"].toInt());
    return {g[0], torch::Tensor()};
  }
};

using torch::autograd::Node;

// Counts how often each autograd node runs (by identity: node names change between LibTorch
// versions, e.g. `TBackward` became `TBackward0`, so the tests never look at them).
struct CountRuns final : torch::autograd::FunctionPreHook {
  CountRuns(const Node* node, std::map<const Node*, int>* runs) : node_(node), runs_(runs) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& g) override {
    ++(*runs_)[node_];
    return g;
  }
  const Node* node_;
  std::map<const Node*, int>* runs_;
};

// The autograd graph behind `y`: every node once, with the nodes its edges lead to.
struct Graph {
  std::vector<std::shared_ptr<Node>> nodes;
  std::map<const Node*, std::vector<const Node*>> next;
};

Graph graph_of(const torch::Tensor& y) {
  Graph g;
  std::vector<std::shared_ptr<Node>> todo{y.grad_fn()};
  std::set<const Node*> seen;
  while (!todo.empty()) {
    auto n = todo.back();
    todo.pop_back();
    if (!seen.insert(n.get()).second) continue;
    g.nodes.push_back(n);
    auto& out = g.next[n.get()];
    for (const auto& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      out.push_back(e.function.get());
      todo.push_back(e.function);
    }
  }
  return g;
}

// Whether a path leads from `n` to one of `targets` (n itself counts).
bool reaches(const Graph& g, const Node* n, const std::set<const Node*>& targets,
             std::map<const Node*, bool>& memo) {
  if (targets.count(n)) return true;
  if (auto it = memo.find(n); it != memo.end()) return it->second;
  bool found = false;
  for (const Node* m : g.next.at(n)) found = found || reaches(g, m, targets, memo);
  return memo[n] = found;
}

void count_runs(const Graph& g, std::map<const Node*, int>* runs) {
  for (const auto& n : g.nodes) n->add_pre_hook(std::make_unique<CountRuns>(n.get(), runs));
}

const Node* grad_node(const torch::Tensor& leaf) {
  return torch::autograd::impl::gradient_edge(leaf).function.get();
}

std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params)
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

void zero(const std::vector<torch::Tensor>& params) {
  for (auto p : params) p.mutable_grad() = torch::Tensor();
}

// Runs `f` on a fresh leaf copy of `x` twice, once with one backward and once split into I and W,
// and checks that the input gradient and the parameters' gradients are bit for bit equal.
void check_split_equals_full(
    const std::function<std::vector<torch::Tensor>(const torch::Tensor&)>& f,
    const torch::Tensor& x0, const std::vector<torch::Tensor>& params) {
  zero(params);
  auto x = x0.detach().requires_grad_(x0.requires_grad());
  auto ys = f(x);
  std::vector<torch::Tensor> gs;
  for (const auto& y : ys) gs.push_back(torch::ones_like(y) * 0.5);
  torch::autograd::backward(ys, gs);
  const auto expected = grads_of(params);
  const auto expected_dx = x.grad();
  zero(params);

  auto x2 = x0.detach().requires_grad_(x0.requires_grad());
  SplitBackward split;
  auto dx = split.input_grad(f(x2), gs, {x2});
  REQUIRE(dx.size() == 1);
  CHECK(dx[0].defined() == expected_dx.defined());
  if (expected_dx.defined()) CHECK(dx[0].equal(expected_dx));
  for (const auto& p : params) CHECK_FALSE(p.grad().defined());  // I leaves the weights alone
  split.weight_grad();
  const auto got = grads_of(params);
  for (std::size_t k = 0; k < params.size(); ++k) {
    CAPTURE(k);
    REQUIRE(got[k].defined() == expected[k].defined());
    if (got[k].defined()) CHECK(got[k].equal(expected[k]));
  }
}

}  // namespace

TEST_SUITE("split backward") {
  TEST_CASE("I then W equals one backward, and W does not repeat the input-gradient chain") {
    torch::manual_seed(0);
    torch::nn::Linear a(4, 6);
    torch::nn::Linear b(6, 3);
    int calls = 0;
    auto f = [&](const torch::Tensor& x) {
      return std::vector<torch::Tensor>{b(Counted::apply(torch::relu(a(x)), &calls))};
    };
    auto params = a->parameters();
    for (auto& p : b->parameters()) params.push_back(p);
    check_split_equals_full(f, torch::randn({5, 4}, torch::requires_grad()), params);
    CHECK(calls == 2);  // once in the full backward, once in I, never in W
  }

  TEST_CASE("I runs only the input-gradient path and W only the weight branches") {
    torch::manual_seed(6);
    torch::nn::Sequential stage;
    for (int i = 0; i < 4; ++i) {
      stage->push_back(torch::nn::Linear(8, 8));
      stage->push_back(torch::nn::ReLU());
    }
    auto x = torch::randn({3, 8}, torch::requires_grad());
    auto y = stage->forward(x);

    // Split the graph by what each node leads to: the input path (nodes with a path to x's
    // gradient) and the weight-only branches (nodes that lead to parameters but not to x).
    const Graph g = graph_of(y);
    std::set<const Node*> params;
    for (const auto& p : stage->parameters()) params.insert(grad_node(p));
    std::map<const Node*, bool> to_x, to_params;
    std::set<const Node*> input_path, weight_only, joints;
    for (const auto& n : g.nodes) {
      if (n.get() == grad_node(x)) continue;
      if (reaches(g, n.get(), {grad_node(x)}, to_x)) {
        input_path.insert(n.get());
      } else if (reaches(g, n.get(), params, to_params)) {
        weight_only.insert(n.get());
      }
    }
    for (const Node* n : input_path) {
      for (const Node* m : g.next.at(n)) {
        if (weight_only.count(m)) joints.insert(n);  // where a layer's weight branch leaves
      }
    }
    CHECK(joints.size() == 4);  // one per Linear layer
    int accumulators = 0;
    for (const Node* n : weight_only) {
      accumulators += dynamic_cast<const torch::autograd::AccumulateGrad*>(n) != nullptr;
    }
    CHECK(accumulators == 8);  // 4 weights, 4 biases

    std::map<const Node*, int> runs;
    count_runs(g, &runs);
    SplitBackward split;
    split.input_grad({y}, {torch::ones_like(y)}, {x});
    std::map<const Node*, int> expected;
    for (const Node* n : input_path) expected[n] = 1;
    CHECK(runs == expected);  // every node of the input path once, nothing else
    runs.clear();
    split.weight_grad();
    // The joints again (for their weight and bias only) and the weight branches, once each; the
    // rest of the input path (the ReLUs) not again: its gradients are reused.
    expected.clear();
    for (const Node* n : joints) expected[n] = 1;
    for (const Node* n : weight_only) expected[n] = 1;
    CHECK(runs == expected);
    CHECK(input_path.size() > joints.size());
  }

  TEST_CASE("without an input that needs a gradient, W does the whole backward") {
    torch::manual_seed(1);
    torch::nn::Linear a(4, 6);
    torch::nn::Linear b(6, 3);
    auto f = [&](const torch::Tensor& x) {
      return std::vector<torch::Tensor>{b(torch::tanh(a(x)))};
    };
    auto params = a->parameters();
    for (auto& p : b->parameters()) params.push_back(p);
    check_split_equals_full(f, torch::randn({5, 4}), params);
  }

  TEST_CASE(
      "parameters behind parameter-only branches and outputs of parameters alone are covered") {
    torch::manual_seed(2);
    auto w = torch::randn({4}, torch::requires_grad());
    auto c = torch::randn({3}, torch::requires_grad());
    auto f = [&](const torch::Tensor& x) {
      return std::vector<torch::Tensor>{x * w.exp(), c * 2.0, (x * x).sum(1)};
    };
    check_split_equals_full(f, torch::randn({5, 4}, torch::requires_grad()), {w, c});
  }

  TEST_CASE("a module applied twice gets the sum of both uses, and W still skips the input chain") {
    torch::manual_seed(3);
    torch::nn::Linear a(4, 4);
    int calls = 0;
    auto f = [&](const torch::Tensor& x) {
      return std::vector<torch::Tensor>{a(Counted::apply(torch::relu(a(x)), &calls))};
    };
    check_split_equals_full(f, torch::randn({5, 4}, torch::requires_grad()), a->parameters());
    CHECK(calls == 2);  // once in the full backward, once in I
  }

  TEST_CASE("one parameter-only node feeding two layers adds both layers' gradients once") {
    torch::manual_seed(5);
    auto w = torch::randn({4, 4}, torch::requires_grad());
    auto f = [&](const torch::Tensor& x) {
      auto wt = w.t();  // one node, used by both products
      return std::vector<torch::Tensor>{torch::relu(x.mm(wt)).mm(wt)};
    };
    check_split_equals_full(f, torch::randn({5, 4}, torch::requires_grad()), {w});
  }

  TEST_CASE("outputs without a gradient and inputs the outputs do not use are skipped") {
    torch::manual_seed(4);
    torch::nn::Linear a(4, 2);
    auto x = torch::randn({3, 4}, torch::requires_grad());
    auto unused = torch::randn({3}, torch::requires_grad());
    SplitBackward split;
    auto y = a(x);
    auto dx = split.input_grad({y, torch::zeros({2})}, {torch::ones_like(y), torch::Tensor()},
                               {x, unused});
    REQUIRE(dx.size() == 2);
    CHECK(dx[0].defined());
    CHECK_FALSE(dx[1].defined());
    split.weight_grad();
    CHECK(a->weight.grad().defined());
  }
}
