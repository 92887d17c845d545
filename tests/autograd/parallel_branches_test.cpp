#include "stagewise/autograd/parallel_branches.hpp"

#include <ATen/autocast_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include "tests/support/autocast.hpp"
#include "tests/support/errors.hpp"
#include "tests/support/grads.hpp"
#include "tests/support/threads.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using stagewise::testing::error_of;
using stagewise::testing::contains;

namespace {

// Threads meet here: `arrive` returns true if `count` threads arrived within two seconds, which
// can only happen if they run at the same time.
struct Rendezvous {
  explicit Rendezvous(int count) : count(count) {}
  bool arrive() {
    std::unique_lock<std::mutex> lock(mutex);
    if (++arrived == count) cv.notify_all();
    return cv.wait_for(lock, std::chrono::seconds(2), [&] { return arrived >= count; });
  }
  int count;
  int arrived = 0;
  std::mutex mutex;
  std::condition_variable cv;
};

// Identity whose backward first runs `hook` (to observe or to fail the backward of a branch).
struct BackwardHook : torch::autograd::Function<BackwardHook> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, std::function<void()>* hook) {
    ctx->saved_data["hook"] = reinterpret_cast<int64_t>(hook);
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    (*reinterpret_cast<std::function<void()>*>(ctx->saved_data["hook"].toInt()))();
    return {g[0], torch::Tensor()};
  }
};

torch::nn::Sequential mlp(int64_t in, int64_t hidden, int64_t out) {
  return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, out));
}

using stagewise::testing::grads_of;
using stagewise::testing::zero_grads;
using stagewise::testing::set_cpu_autocast;

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() && !a[i].equal(b[i])) return false;
  }
  return true;
}

// CPU autocast on for its lifetime (off and cache cleared afterwards, even on a failed check).
struct CpuAutocast {
  CpuAutocast() { set_cpu_autocast(true); }
  ~CpuAutocast() {
    set_cpu_autocast(false);
    at::autocast::clear_cache();
  }
};

// Three towers of different widths on separate inputs, for the equality tests.
struct Towers {
  std::vector<torch::nn::Sequential> nets{mlp(8, 16, 4), mlp(8, 32, 4), mlp(8, 8, 4)};
  std::vector<torch::Tensor> inputs{torch::randn({5, 8}, torch::requires_grad()),
                                    torch::randn({7, 8}, torch::requires_grad()),
                                    torch::randn({3, 8}, torch::requires_grad())};
  std::vector<sw::TensorBranch> branches() {
    std::vector<sw::TensorBranch> result;
    for (auto& net : nets)
      result.push_back([net](const torch::Tensor& x) mutable { return net->forward(x); });
    return result;
  }
  std::vector<torch::Tensor> leaves() {
    auto all = inputs;
    for (auto& net : nets) {
      for (auto& p : net->parameters()) all.push_back(p);
    }
    return all;
  }
};

torch::Tensor loss_of(const std::vector<torch::Tensor>& outs) {
  auto loss = torch::zeros({});
  for (std::size_t i = 0; i < outs.size(); ++i) loss = loss + outs[i].pow(2).sum() * double(i + 1);
  return loss;
}

}  // namespace

TEST_SUITE("parallel branches: results") {
  TEST_CASE("outputs and gradients equal running the branches one after another, bitwise") {
    torch::manual_seed(0);
    Towers towers;
    std::vector<torch::Tensor> sequential;
    for (std::size_t i = 0; i < towers.nets.size(); ++i) {
      sequential.push_back(towers.nets[i]->forward(towers.inputs[i]));
    }
    loss_of(sequential).backward();
    const auto expected = grads_of(towers.leaves());
    zero_grads(towers.leaves());

    auto parallel = sw::parallel_branches(towers.branches(), towers.inputs);
    CHECK(all_equal(parallel, sequential));
    for (const auto& out : parallel) CHECK(out.requires_grad());
    loss_of(parallel).backward();
    CHECK(all_equal(grads_of(towers.leaves()), expected));
  }

  TEST_CASE("branches that share an input: its gradient is the sum over the branches") {
    torch::manual_seed(1);
    auto x = torch::randn({4, 8}, torch::requires_grad());
    auto a = mlp(8, 16, 4);
    auto b = mlp(8, 8, 4);
    auto run = [&](bool parallel) {
      x.mutable_grad().reset();
      std::vector<torch::Tensor> outs;
      if (parallel) {
        outs = sw::parallel_branches({[&](const torch::Tensor& t) { return a->forward(t); },
                                      [&](const torch::Tensor& t) { return b->forward(t); }},
                                     {x, x});
      } else {
        outs = {a->forward(x), b->forward(x)};
      }
      loss_of(outs).backward();
      return x.grad().clone();
    };
    const auto sequential = run(false);
    const auto parallel = run(true);
    CHECK(parallel.equal(sequential));  // two terms: the sum is the same in any order

    // Four branches on one input: the same sum, possibly rounded in another order.
    std::vector<torch::nn::Sequential> nets{mlp(8, 4, 2), mlp(8, 4, 2), mlp(8, 4, 2), mlp(8, 4, 2)};
    std::vector<sw::TensorBranch> branches;
    for (auto& net : nets)
      branches.push_back([net](const torch::Tensor& t) mutable { return net->forward(t); });
    x.mutable_grad().reset();
    loss_of(sw::parallel_branches(branches, std::vector<torch::Tensor>(4, x))).backward();
    const auto parallel4 = x.grad().clone();
    x.mutable_grad().reset();
    std::vector<torch::Tensor> outs;
    for (auto& net : nets) outs.push_back(net->forward(x));
    loss_of(outs).backward();
    CHECK(torch::allclose(parallel4, x.grad(), 1e-6, 1e-6));
  }

  TEST_CASE("branches of different lengths, arities and shapes give the sequential results") {
    torch::manual_seed(2);
    auto w = torch::randn({6, 3}, torch::requires_grad());
    auto a = torch::randn({2, 6}, torch::requires_grad());
    auto b = torch::randn({2, 6}, torch::requires_grad());
    auto c = torch::randn({9}, torch::requires_grad());
    auto mask = torch::tensor({1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0});  // no grad
    auto deep = mlp(9, 9, 9);
    std::atomic<bool> third_input_defined{true};
    std::vector<sw::Branch> branches{
        // two inputs, one output
        [&](const variable_list& in) { return variable_list{(in[0] * in[1]).matmul(w)}; },
        // three inputs (one without grad, one undefined), three outputs of different shapes and
        // dtypes, one of them undefined
        [&](const variable_list& in) {
          third_input_defined = in[2].defined();
          auto y = in[0] * in[1];
          return variable_list{y.sum(), y.view({3, 3}).exp(), torch::Tensor(), y.argmax()};
        },
        // a long chain
        [&](const variable_list& in) {
          auto y = in[0].unsqueeze(0);
          for (int i = 0; i < 20; ++i) y = deep->forward(y).tanh();
          return variable_list{y};
        }};
    std::vector<variable_list> inputs{{a, b}, {c, mask, torch::Tensor()}, {c}};
    auto combine = [](const std::vector<variable_list>& outs) {
      CHECK(outs[0].size() == 1);
      CHECK(outs[1].size() == 4);
      CHECK_FALSE(outs[1][2].defined());
      CHECK((outs[1][3].scalar_type() == torch::kLong));
      CHECK_FALSE(outs[1][3].requires_grad());
      return outs[0][0].sum() + outs[1][0] * 2 + outs[1][1].sum() + outs[2][0].pow(2).sum();
    };
    std::vector<torch::Tensor> leaves{w, a, b, c};
    for (auto& p : deep->parameters()) leaves.push_back(p);

    std::vector<variable_list> sequential;
    for (std::size_t i = 0; i < branches.size(); ++i) sequential.push_back(branches[i](inputs[i]));
    combine(sequential).backward();
    const auto expected = grads_of(leaves);
    zero_grads(leaves);

    auto parallel = sw::parallel_branches(branches, inputs);
    for (std::size_t i = 0; i < parallel.size(); ++i) {
      REQUIRE(parallel[i].size() == sequential[i].size());
      for (std::size_t j = 0; j < parallel[i].size(); ++j) {
        CHECK(parallel[i][j].defined() == sequential[i][j].defined());
        if (parallel[i][j].defined()) CHECK(parallel[i][j].equal(sequential[i][j]));
      }
    }
    CHECK_FALSE(third_input_defined);
    combine(parallel).backward();
    CHECK(all_equal(grads_of(leaves), expected));
  }

  TEST_CASE("a branch may return its input unchanged, or a view of it") {
    auto x = torch::randn({2, 3}, torch::requires_grad());
    auto y = torch::randn({2, 3}, torch::requires_grad());
    auto outs = sw::parallel_branches(
        {[](const torch::Tensor& t) { return t; }, [](const torch::Tensor& t) { return t.t(); }},
        {x, y});
    CHECK(outs[0].equal(x));
    CHECK(outs[1].equal(y.t()));
    (outs[0] * 3).sum().backward({}, /*retain_graph=*/true);
    CHECK(x.grad().equal(torch::full({2, 3}, 3.0f)));
    CHECK_FALSE(y.grad().defined());
    (outs[1] * torch::arange(2).view({1, 2})).sum().backward();
    CHECK(y.grad().equal(torch::arange(2).view({2, 1}).expand({2, 3}).to(torch::kFloat)));
  }

  TEST_CASE(
      "an output left out of the loss gets no gradient, and its branch's backward is skipped") {
    auto a = mlp(4, 4, 4);
    auto b = mlp(4, 4, 4);
    auto x = torch::randn({2, 4}, torch::requires_grad());
    auto outs = sw::parallel_branches({[&](const torch::Tensor& t) { return a->forward(t); },
                                       [&](const torch::Tensor& t) { return b->forward(t); }},
                                      {x, x});
    outs[0].sum().backward();
    for (auto& p : a->parameters()) CHECK(p.grad().defined());
    for (auto& p : b->parameters()) CHECK_FALSE(p.grad().defined());
    CHECK(x.grad().defined());
  }

  TEST_CASE("parameters get gradients even when no input requires grad") {
    auto a = mlp(4, 4, 4);
    auto x = torch::randn({2, 4});
    auto outs = sw::parallel_branches({[&](const torch::Tensor& t) { return a->forward(t); },
                                       [&](const torch::Tensor& t) { return t * 2; }},
                                      {x, x});
    CHECK(outs[0].requires_grad());
    CHECK_FALSE(outs[1].requires_grad());
    CHECK_FALSE(outs[1].grad_fn());
    outs[0].sum().backward();
    for (auto& p : a->parameters()) CHECK(p.grad().defined());
  }

  TEST_CASE("torch::autograd::grad gives the input gradients and leaves parameter .grad alone") {
    auto a = mlp(4, 4, 4);
    auto x = torch::randn({2, 4}, torch::requires_grad());
    auto y = torch::randn({2, 4}, torch::requires_grad());
    auto outs = sw::parallel_branches({[&](const torch::Tensor& t) { return a->forward(t); },
                                       [&](const torch::Tensor& t) { return t.sin(); }},
                                      {x, y});
    auto loss = outs[0].sum() + outs[1].sum();
    auto gy = torch::autograd::grad({loss}, {y}, {}, /*retain_graph=*/true)[0];
    CHECK(gy.allclose(y.cos()));
    CHECK_FALSE(y.grad().defined());
    for (auto& p : a->parameters()) CHECK_FALSE(p.grad().defined());
    auto gx = torch::autograd::grad({loss}, {x})[0];
    auto expected = torch::autograd::grad({a->forward(x).sum()}, {x})[0];
    CHECK(gx.equal(expected));
  }

  TEST_CASE("with retain_graph a second backward gives the same gradients again") {
    auto x = torch::randn({3}, torch::requires_grad());
    auto outs = sw::parallel_branches({[](const torch::Tensor& t) { return t.exp(); },
                                       [](const torch::Tensor& t) { return t * t; }},
                                      {x, x});
    auto loss = outs[0].sum() + outs[1].sum();
    loss.backward({}, /*retain_graph=*/true);
    const auto first = x.grad().clone();
    x.mutable_grad().reset();
    loss.backward();
    CHECK(x.grad().equal(first));
    CHECK(first.allclose(x.exp() + 2 * x));
  }

  TEST_CASE("the branches' graphs are freed after backward") {
    std::weak_ptr<torch::autograd::Node> inner;
    auto x = torch::randn({3}, torch::requires_grad());
    auto payload = torch::randn({3});
    {
      auto outs = sw::parallel_branches({[&](const torch::Tensor& t) {
                                           auto y = t * payload;  // saves payload
                                           inner = y.grad_fn();
                                           return y;
                                         },
                                         [](const torch::Tensor& t) { return t + 1; }},
                                        {x, x});
      CHECK_FALSE(inner.expired());
      CHECK(payload.use_count() > 1);
      (outs[0].sum() + outs[1].sum()).backward();
      CHECK(inner.expired());  // released by backward, before the outputs go away
    }
    CHECK(payload.use_count() == 1);
  }
}

TEST_SUITE("parallel branches: threads") {
  TEST_CASE("branch forwards run at the same time on different threads") {
    auto pool = std::make_shared<sw::ThreadPool>(2);
    Rendezvous meet(2);
    std::vector<std::thread::id> ids(2);
    std::vector<int> met(2);
    auto branch = [&](int i) {
      return [&, i](const torch::Tensor& t) {
        ids[i] = std::this_thread::get_id();
        met[i] = meet.arrive();
        return t * 2;
      };
    };
    auto x = torch::ones({2}, torch::requires_grad());
    sw::parallel_branches({branch(0), branch(1)}, {x, x}, pool);
    CHECK(met[0]);
    CHECK(met[1]);
    CHECK(ids[0] != ids[1]);
  }

  TEST_CASE("branch backwards run at the same time on different threads") {
    auto pool = std::make_shared<sw::ThreadPool>(2);
    Rendezvous meet(2);
    std::vector<std::thread::id> ids(2);
    std::vector<int> met(2);
    std::vector<std::function<void()>> hooks;
    for (int i = 0; i < 2; ++i) {
      hooks.push_back([&, i] {
        ids[i] = std::this_thread::get_id();
        met[i] = meet.arrive();
      });
    }
    auto x = torch::ones({2}, torch::requires_grad());
    auto outs = sw::parallel_branches(
        {[&](const torch::Tensor& t) { return BackwardHook::apply(t, &hooks[0]); },
         [&](const torch::Tensor& t) { return BackwardHook::apply(t, &hooks[1]); }},
        {x, x}, pool);
    (outs[0].sum() + outs[1].sum()).backward();
    CHECK(met[0]);
    CHECK(met[1]);
    CHECK(ids[0] != ids[1]);
    CHECK(x.grad().equal(torch::full({2}, 2.0f)));
  }

  TEST_CASE(
      "a branch whose graph reaches another device runs its backward on the node's thread, the "
      "CPU branches still on the pool") {
    // The meta device stands in for CUDA: its nodes are not CPU nodes, so its branch takes the
    // path a CUDA branch takes (see docs/parallel_backward.md, On CUDA), on a machine without one.
    auto pool = std::make_shared<sw::ThreadPool>(2);
    Rendezvous meet(2);
    std::vector<std::thread::id> ids(3);
    std::vector<int> met(3);
    std::vector<std::function<void()>> hooks;
    hooks.push_back([&] { ids[0] = std::this_thread::get_id(); });
    for (int i = 1; i < 3; ++i) {
      hooks.push_back([&, i] {
        ids[i] = std::this_thread::get_id();
        met[i] = meet.arrive();
      });
    }
    auto on_meta =
        torch::empty({2}, torch::TensorOptions().device(torch::kMeta)).requires_grad_(true);
    auto x = torch::ones({2}, torch::requires_grad());
    auto outs = sw::parallel_branches(
        {[&](const torch::Tensor& t) { return BackwardHook::apply(t * 2, &hooks[0]); },
         [&](const torch::Tensor& t) { return BackwardHook::apply(t * 3, &hooks[1]); },
         [&](const torch::Tensor& t) { return BackwardHook::apply(t * 4, &hooks[2]); }},
        {on_meta, x, x}, pool);
    CHECK(outs[0].device().type() == torch::kMeta);
    torch::autograd::backward({outs[0].sum(), outs[1].sum(), outs[2].sum()});
    CHECK(ids[0] == std::this_thread::get_id());
    CHECK(met[1]);
    CHECK(met[2]);
    CHECK(ids[1] != ids[2]);
    REQUIRE(on_meta.grad().defined());
    CHECK(on_meta.grad().device().type() == torch::kMeta);
    CHECK(on_meta.grad().sizes() == on_meta.sizes());
    CHECK(x.grad().equal(torch::full({2}, 7.0f)));
  }

  TEST_CASE("under no-grad the branches run in parallel and nothing is recorded") {
    auto pool = std::make_shared<sw::ThreadPool>(2);
    Rendezvous meet(2);
    std::atomic<int> grad_enabled{0};
    std::vector<int> met(2);
    auto x = torch::ones({2}, torch::requires_grad());
    auto a = mlp(2, 2, 2);
    std::vector<torch::Tensor> outs;
    {
      torch::NoGradGuard no_grad;
      outs = sw::parallel_branches({[&](const torch::Tensor& t) {
                                      grad_enabled += torch::GradMode::is_enabled();
                                      met[0] = meet.arrive();
                                      return a->forward(t);
                                    },
                                    [&](const torch::Tensor& t) {
                                      grad_enabled += torch::GradMode::is_enabled();
                                      met[1] = meet.arrive();
                                      return t * 2;
                                    }},
                                   {x, x}, pool);
    }
    CHECK(met[0]);
    CHECK(met[1]);
    CHECK(grad_enabled == 0);
    for (const auto& out : outs) {
      CHECK_FALSE(out.requires_grad());
      CHECK_FALSE(out.grad_fn());
    }
  }

  TEST_CASE("grad mode, inference mode and autocast reach the workers") {
    auto pool = std::make_shared<sw::ThreadPool>(2);
    std::vector<int> grad(2, -1);
    std::vector<int> inference(2, -1);
    auto probe = [&](int i) {
      return [&, i](const torch::Tensor& t) {
        grad[i] = torch::GradMode::is_enabled();
        inference[i] = c10::InferenceMode::is_enabled();
        return t * 2;
      };
    };
    auto x = torch::ones({2}, torch::requires_grad());
    sw::parallel_branches({probe(0), probe(1)}, {x, x}, pool);
    CHECK(grad == std::vector<int>{1, 1});
    CHECK(inference == std::vector<int>{0, 0});
    {
      c10::InferenceMode guard;
      auto outs = sw::parallel_branches({probe(0), probe(1)}, {x, x}, pool);
      CHECK(outs[1].is_inference());
    }
    CHECK(grad == std::vector<int>{0, 0});
    CHECK(inference == std::vector<int>{1, 1});

    // Autocast on CPU turns a Linear's float32 into bfloat16, on the workers as on the caller.
    auto lin = torch::nn::Linear(4, 4);
    auto in = torch::randn({2, 4});
    auto branch = [&](const torch::Tensor& t) { return lin->forward(t); };
    torch::Tensor sequential;
    std::vector<torch::Tensor> parallel;
    {
      CpuAutocast autocast;
      sequential = lin->forward(in);
      parallel = sw::parallel_branches({branch, branch}, {in, in}, pool);
      // A second call in the same autocast region: the caller's cast cache is not shared.
      parallel = sw::parallel_branches({branch, branch}, {in, in}, pool);
    }
    CHECK((sequential.scalar_type() == torch::kBFloat16));
    CHECK((parallel[0].scalar_type() == torch::kBFloat16));
    CHECK((parallel[1].scalar_type() == torch::kBFloat16));
    CHECK(parallel[1].equal(sequential));
  }

  TEST_CASE("workers use the caller's intra-op thread count") {
    auto pool = std::make_shared<sw::ThreadPool>(2);
    const int original = at::get_num_threads();
    std::vector<int> seen(2);
    auto probe = [&](int i) {
      return [&, i](const torch::Tensor& t) {
        seen[i] = at::get_num_threads();
        return t;
      };
    };
    auto x = torch::ones({2});
    sw::parallel_branches({probe(0), probe(1)}, {x, x}, pool);  // workers initialised
    at::set_num_threads(1);
    sw::parallel_branches({probe(0), probe(1)}, {x, x}, pool);
    CHECK(seen == std::vector<int>{1, 1});
    at::set_num_threads(original);
    sw::parallel_branches({probe(0), probe(1)}, {x, x}, pool);
    CHECK(seen == std::vector<int>{original, original});
  }

  TEST_CASE("works when called from a std::thread that is not the main thread") {
    torch::manual_seed(3);
    Towers towers;
    std::vector<torch::Tensor> sequential;
    for (std::size_t i = 0; i < towers.nets.size(); ++i) {
      sequential.push_back(towers.nets[i]->forward(towers.inputs[i]));
    }
    loss_of(sequential).backward();
    const auto expected = grads_of(towers.leaves());

    // Forward and backward both on another thread.
    zero_grads(towers.leaves());
    std::vector<torch::Tensor> parallel;
    std::thread([&] {
      parallel = sw::parallel_branches(towers.branches(), towers.inputs);
      loss_of(parallel).backward();
    }).join();
    CHECK(all_equal(parallel, sequential));
    CHECK(all_equal(grads_of(towers.leaves()), expected));

    // Forward on a worker thread (as in a pipeline stage), backward on the main thread.
    zero_grads(towers.leaves());
    std::thread([&] { parallel = sw::parallel_branches(towers.branches(), towers.inputs); }).join();
    loss_of(parallel).backward();
    CHECK(all_equal(grads_of(towers.leaves()), expected));
  }

  TEST_CASE("parallel_branches nested inside a branch does not deadlock") {
    auto pool = std::make_shared<sw::ThreadPool>(2);
    auto x = torch::randn({3}, torch::requires_grad());
    auto inner = [&](const torch::Tensor& t) {
      auto outs = sw::parallel_branches({[](const torch::Tensor& u) { return u * 2; },
                                         [](const torch::Tensor& u) { return u * 3; },
                                         [](const torch::Tensor& u) { return u * 4; }},
                                        {t, t, t}, pool);
      return outs[0] + outs[1] + outs[2];
    };
    auto outs = sw::parallel_branches({inner, inner, inner}, {x, x, x}, pool);
    (outs[0] + outs[1] + outs[2]).sum().backward();
    CHECK(x.grad().equal(torch::full({3}, 27.0f)));
  }

  TEST_CASE("repeated calls reuse the pool: no thread is created per call") {
    auto x = torch::randn({3}, torch::requires_grad());
    auto call = [&] {
      auto outs = sw::parallel_branches({[](const torch::Tensor& t) { return t * 2; },
                                         [](const torch::Tensor& t) { return t * 3; }},
                                        {x, x});
      (outs[0] + outs[1]).sum().backward();
    };
    call();
    const auto before = sw::testing::stable_thread_count();
    for (int i = 0; i < 50; ++i) call();
    CHECK(sw::testing::settled_thread_count(before) == before);
  }
}

namespace {

// A minimal stand-in for checkpointing: forward runs `fn` under no-grad and keeps only the input;
// backward re-runs `fn` with grad enabled and calls torch::autograd::backward on the recomputed
// outputs from inside this node's backward (a nested, reentrant backward).
struct RecomputeInBackward : torch::autograd::Function<RecomputeInBackward> {
  using Fn = std::function<torch::Tensor(const torch::Tensor&)>;
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, Fn* fn) {
    ctx->saved_data["fn"] = reinterpret_cast<int64_t>(fn);
    ctx->save_for_backward({x});
    return (*fn)(x);  // Function::apply runs forward under no-grad
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* fn = reinterpret_cast<Fn*>(ctx->saved_data["fn"].toInt());
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = (*fn)(x);
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor()};
  }
};

}  // namespace

TEST_SUITE("parallel branches: nesting") {
  TEST_CASE(
      "inside a nested backward (a checkpoint stand-in) gradients equal the sequential ones") {
    torch::manual_seed(4);
    auto a = mlp(6, 12, 6);
    auto b = mlp(6, 6, 6);
    auto x = torch::randn({4, 6}, torch::requires_grad());
    std::vector<torch::Tensor> leaves{x};
    for (auto& p : a->parameters()) leaves.push_back(p);
    for (auto& p : b->parameters()) leaves.push_back(p);

    auto sequential_block = [&](const torch::Tensor& t) {
      return a->forward(t) * b->forward(t.sin());
    };
    std::atomic<int> parallel_runs{0};
    RecomputeInBackward::Fn parallel_block = [&](const torch::Tensor& t) {
      ++parallel_runs;
      auto outs = sw::parallel_branches({[&](const torch::Tensor& u) { return a->forward(u); },
                                         [&](const torch::Tensor& u) { return b->forward(u); }},
                                        {t, t.sin()});
      return outs[0] * outs[1];
    };

    auto expected_out = sequential_block(x * 2);
    (expected_out.pow(2).sum()).backward();
    const auto expected = grads_of(leaves);
    zero_grads(leaves);

    auto out = RecomputeInBackward::apply(x * 2, &parallel_block);
    CHECK(out.equal(expected_out));
    CHECK(parallel_runs == 1);
    out.pow(2).sum().backward();
    CHECK(parallel_runs == 2);  // recomputed in backward
    CHECK(all_equal(grads_of(leaves), expected));
  }
}

TEST_SUITE("parallel branches: errors") {
  TEST_CASE("a c10::Error from a branch's forward reaches the caller unchanged, nothing hangs") {
    auto pool = std::make_shared<sw::ThreadPool>(2);
    std::atomic<int> running{0};
    std::atomic<int> finished{0};
    std::vector<sw::TensorBranch> branches;
    for (int i = 0; i < 8; ++i) {
      branches.push_back([&, i](const torch::Tensor& t) {
        ++running;
        if (i == 3) {
          --running;
          TORCH_CHECK(false, "expert 3 failed");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        --running;
        ++finished;
        return t * 2;
      });
    }
    auto x = torch::ones({2}, torch::requires_grad());
    bool caught = false;
    try {
      sw::parallel_branches(branches, std::vector<torch::Tensor>(8, x), pool);
    } catch (const c10::Error& e) {
      caught = true;
      CHECK(e.msg() == "expert 3 failed");
    }
    CHECK(caught);
    CHECK(running == 0);   // nothing still runs once the exception arrives
    CHECK(finished <= 7);  // the others finished or were skipped
    // The pool is still usable.
    auto outs = sw::parallel_branches({branches[0], branches[1]}, {x, x}, pool);
    CHECK(outs[1].equal(x * 2));
  }

  TEST_CASE("an exception of another type from a branch reaches the caller as that type") {
    struct ExpertError : std::runtime_error {
      using std::runtime_error::runtime_error;
    };
    auto x = torch::ones({2});
    CHECK_THROWS_AS(sw::parallel_branches({[](const torch::Tensor& t) { return t; },
                                           [](const torch::Tensor&) -> torch::Tensor {
                                             throw ExpertError("custom");
                                           }},
                                          {x, x}),
                    ExpertError);
  }

  TEST_CASE("the exception of the lowest-numbered failing branch wins") {
    auto pool = std::make_shared<sw::ThreadPool>(1);  // in order: both branches run
    auto x = torch::ones({2});
    std::string message;
    try {
      sw::parallel_branches({[](const torch::Tensor& t) { return t; },
                             [](const torch::Tensor&) -> torch::Tensor {
                               TORCH_CHECK(false, "first");
                               return {};
                             },
                             [](const torch::Tensor&) -> torch::Tensor {
                               TORCH_CHECK(false, "second");
                               return {};
                             }},
                            {x, x, x}, pool);
    } catch (const c10::Error& e) {
      message = e.msg();
    }
    CHECK(message == "first");
  }

  TEST_CASE("an error in a branch's backward reaches the caller of backward, nothing hangs") {
    auto pool = std::make_shared<sw::ThreadPool>(2);
    std::atomic<int> other_backward{0};
    std::function<void()> fail = [] { TORCH_CHECK(false, "backward of expert 1 failed"); };
    std::function<void()> count = [&] { ++other_backward; };
    auto x = torch::ones({2}, torch::requires_grad());
    auto outs = sw::parallel_branches(
        {[&](const torch::Tensor& t) { return BackwardHook::apply(t, &count); },
         [&](const torch::Tensor& t) { return BackwardHook::apply(t, &fail); }},
        {x, x}, pool);
    bool caught = false;
    try {
      (outs[0].sum() + outs[1].sum()).backward();
    } catch (const c10::Error& e) {
      caught = true;
      CHECK(contains(e.what_without_backtrace(), "backward of expert 1 failed"));
    }
    CHECK(caught);
    CHECK(other_backward <= 1);
    // Autograd and the pool still work afterwards.
    auto again = sw::parallel_branches({[](const torch::Tensor& t) { return t * 3; }}, {x}, pool);
    x.mutable_grad().reset();
    again[0].sum().backward();
    CHECK(x.grad().equal(torch::full({2}, 3.0f)));
  }

  TEST_CASE("double backward is refused with an error naming the fix") {
    auto x = torch::randn({3}, torch::requires_grad());
    auto outs = sw::parallel_branches({[](const torch::Tensor& t) { return t * t; }}, {x});
    auto message = error_of([&] {
      torch::autograd::grad({outs[0].sum()}, {x}, {}, /*retain_graph=*/true,
                            /*create_graph=*/true);
    });
    CHECK(contains(message, "double backward (create_graph=true) is not supported"));
    CHECK(contains(message, "Call backward without create_graph"));
  }

  TEST_CASE("a second backward without retain_graph is refused with an error naming the fix") {
    auto x = torch::randn({3}, torch::requires_grad());
    auto outs = sw::parallel_branches({[](const torch::Tensor& t) { return t * 2; }}, {x});
    auto loss = outs[0].sum();
    loss.backward();
    auto message = error_of([&] { loss.backward(); });
    CHECK(contains(message, "their graphs were freed by the first backward"));
    CHECK(contains(message, "Pass retain_graph=true to the first backward"));
  }

  TEST_CASE("a branch using a tensor from the surrounding graph is an error naming the fix") {
    auto w = torch::randn({3}, torch::requires_grad());
    auto scaled = w.exp();  // not a leaf: the branch would backward into the caller's graph
    auto x = torch::randn({3}, torch::requires_grad());
    auto message = error_of([&] {
      sw::parallel_branches({[](const torch::Tensor& t) { return t * 2; },
                             [&](const torch::Tensor& t) { return t * scaled; }},
                            {x, x});
    });
    CHECK(
        contains(message, "branch 1 differentiates through a tensor computed outside the branch"));
    CHECK(contains(message, "ExpBackward0"));
    CHECK(contains(message, "Pass that tensor to the branch as one of its inputs"));
    // Passed in as an input it works, and its gradient arrives.
    auto outs = sw::parallel_branches(
        {[](const variable_list& in) { return variable_list{in[0] * in[1]}; }}, {{x, scaled}});
    outs[0][0].sum().backward();
    CHECK(w.grad().allclose(x * w.exp()));
  }

  TEST_CASE("mismatched branches and inputs, an empty branch and a null pool are errors") {
    auto x = torch::ones({2});
    auto twice = [](const torch::Tensor& t) { return t * 2; };
    CHECK(contains(error_of([&] {
                     sw::parallel_branches({twice, twice}, {x});
                   }),
                   "got 2 branches but 1 input sets. Pass one input set per branch"));
    CHECK(contains(error_of([&] {
                     sw::parallel_branches({twice, sw::TensorBranch()}, {x, x});
                   }),
                   "branch 1 is empty (a default-constructed std::function)"));
    CHECK(contains(error_of([&] { sw::parallel_branches({twice}, {x}, nullptr); }),
                   "the pool is null"));
    CHECK(sw::parallel_branches(std::vector<sw::Branch>{}, {}).empty());
  }
}
