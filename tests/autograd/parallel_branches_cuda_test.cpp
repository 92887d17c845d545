#include "stagewise/autograd/parallel_branches.hpp"
#include "stagewise/nn/parallel_branches.hpp"
#include "stagewise/runtime/stream.hpp"

#include <ATen/autocast_mode.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include "tests/support/autocast.hpp"
#include "tests/support/errors.hpp"
#include "tests/support/grads.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

namespace sw = stagewise;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using stagewise::testing::contains;

namespace {

const bool no_cuda = !torch::cuda::is_available();

torch::Device gpu() {
  return torch::Device(torch::kCUDA, 0);
}

// This thread's current stream on cuda:0.
c10::Stream current_stream() {
  return c10::impl::VirtualGuardImpl(torch::kCUDA).getStream(gpu());
}

// Runs `body` on a thread of its own, on this thread's current stream, and waits for it at most
// `limit`, rethrowing its exception. A body still running then (a hung backward, issue #23) ends
// the test binary with a message instead of blocking the run forever: the thread cannot be
// stopped, and it refers to the caller's locals.
void finishes_within(std::chrono::seconds limit, const char* what, std::function<void()> body) {
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  std::thread([done, body = std::move(body), stream = current_stream()] {
    try {
      c10::StreamGuard on_callers_stream(stream);
      body();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (finished.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr,
                 "parallel_branches_cuda_test: %s did not finish within %lld s: the backward of "
                 "parallel_branches hangs on CUDA. Stopping the test binary.\n",
                 what, static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(1);
  }
  finished.get();
}

constexpr std::chrono::seconds limit{60};

torch::nn::Sequential mlp(int64_t in, int64_t hidden, int64_t out) {
  return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, out));
}

// `value` as a leaf that requires grad, written by the caller's current stream only after a queue
// of other kernels: a branch stream that did not wait for the caller's would read it unwritten.
torch::Tensor late(const torch::Tensor& value) {
  auto busy = torch::ones({1 << 22}, torch::TensorOptions().device(value.device()));
  for (int i = 0; i < 30; ++i) busy = busy * 1.0001f;
  return (value + busy.sum() * 0).requires_grad_(true);
}

// N towers of different widths on cuda:0, each with its own input.
struct Towers {
  explicit Towers(int count) {
    for (int i = 0; i < count; ++i) {
      nets.push_back(mlp(16, 32 + 16 * i, 8));
      nets.back()->to(gpu());
      values.push_back(torch::randn({64 + i, 16}, torch::TensorOptions().device(gpu())));
    }
  }
  std::vector<sw::TensorBranch> branches() {
    std::vector<sw::TensorBranch> result;
    for (auto& net : nets) {
      result.push_back([net](const torch::Tensor& x) mutable { return net->forward(x); });
    }
    return result;
  }
  std::vector<torch::Tensor> parameters() {
    std::vector<torch::Tensor> all;
    for (auto& net : nets) {
      for (auto& p : net->parameters()) all.push_back(p);
    }
    return all;
  }
  std::vector<torch::Tensor> fresh_inputs() {
    std::vector<torch::Tensor> inputs;
    for (const auto& v : values) inputs.push_back(late(v));
    return inputs;
  }
  std::vector<torch::nn::Sequential> nets;
  std::vector<torch::Tensor> values;
};

torch::Tensor loss_of(const std::vector<torch::Tensor>& outs) {
  auto loss = torch::zeros({}, torch::TensorOptions().device(outs.front().device()));
  for (std::size_t i = 0; i < outs.size(); ++i) {
    loss = loss + outs[i].to(torch::kFloat).pow(2).sum() * double(i + 1);
  }
  return loss;
}

using stagewise::testing::grads_of;
using stagewise::testing::zero_grads;

bool all_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
               double rtol = 1e-5, double atol = 1e-6) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (!a[i].defined()) continue;
    if (a[i].device() != b[i].device() || a[i].scalar_type() != b[i].scalar_type()) return false;
    if (!torch::allclose(a[i], b[i], rtol, atol)) return false;
  }
  return true;
}

using stagewise::testing::set_cuda_autocast;

// CUDA autocast on for its lifetime if `enabled` (then off and its cache cleared afterwards, even
// on a failed check).
struct CudaAutocast {
  explicit CudaAutocast(bool enabled) : enabled(enabled) {
    if (enabled) set_cuda_autocast(true);
  }
  ~CudaAutocast() {
    if (!enabled) return;
    set_cuda_autocast(false);
    at::autocast::clear_cache();
  }
  CudaAutocast(const CudaAutocast&) = delete;
  CudaAutocast& operator=(const CudaAutocast&) = delete;
  bool enabled;
};

// Runs the towers one after another and then through parallel_branches (backward bounded in time)
// and checks that outputs, input gradients and parameter gradients agree; with `autocast`, both
// forwards run under CUDA autocast.
void check_against_sequential(Towers& towers, double rtol = 1e-5, double atol = 1e-6,
                              bool autocast = false) {
  auto seq_inputs = towers.fresh_inputs();
  std::vector<torch::Tensor> sequential;
  {
    CudaAutocast region(autocast);
    for (std::size_t i = 0; i < towers.nets.size(); ++i) {
      sequential.push_back(towers.nets[i]->forward(seq_inputs[i]));
    }
  }
  loss_of(sequential).backward();
  const auto expected_params = grads_of(towers.parameters());
  const auto expected_inputs = grads_of(seq_inputs);
  zero_grads(towers.parameters());

  auto inputs = towers.fresh_inputs();
  std::vector<torch::Tensor> parallel;
  {
    CudaAutocast region(autocast);
    parallel = sw::parallel_branches(towers.branches(), inputs);
  }
  CHECK(all_close(parallel, sequential, rtol, atol));
  auto loss = loss_of(parallel);
  finishes_within(limit, "backward", [&] { loss.backward(); });
  CHECK(all_close(grads_of(inputs), expected_inputs, rtol, atol));
  CHECK(all_close(grads_of(towers.parameters()), expected_params, rtol, atol));
}

// What a probe saw: the stream its forward and its backward ran on, and its backward's thread.
struct Probe {
  std::optional<c10::Stream> forward;
  std::optional<c10::Stream> backward;
  std::thread::id thread;
  std::function<void()> on_backward;
};

// Identity that records into a Probe (and runs its `on_backward`, e.g. to fail).
struct Probed : torch::autograd::Function<Probed> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, Probe* probe) {
    probe->forward = current_stream();
    ctx->saved_data["probe"] = reinterpret_cast<int64_t>(probe);
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto* probe = reinterpret_cast<Probe*>(ctx->saved_data["probe"].toInt());
    probe->backward = current_stream();
    probe->thread = std::this_thread::get_id();
    if (probe->on_backward) probe->on_backward();
    return {g[0], torch::Tensor()};
  }
};

}  // namespace

TEST_SUITE("parallel branches on CUDA") {
  TEST_CASE("branches_cuda: 2 and 8 MLP branches give the sequential results, backward finishes" *
            doctest::skip(no_cuda)) {
    for (int count : {2, 8}) {
      CAPTURE(count);
      torch::manual_seed(count);
      Towers towers(count);
      check_against_sequential(towers);
    }
  }

  TEST_CASE("streams_cuda: each branch runs on a stream of its own; the backwards on one thread" *
            doctest::skip(no_cuda)) {
    constexpr int count = 4;
    torch::manual_seed(3);
    Towers towers(count);
    std::vector<Probe> probes(count);
    std::vector<sw::TensorBranch> branches;
    for (int i = 0; i < count; ++i) {
      branches.push_back([&, i](const torch::Tensor& x) {
        return Probed::apply(towers.nets[i]->forward(x), &probes[i]);
      });
    }
    const auto caller = current_stream();
    auto outs = sw::parallel_branches(branches, towers.fresh_inputs());
    auto loss = loss_of(outs);
    std::thread::id backward_caller;
    finishes_within(limit, "backward", [&] {
      backward_caller = std::this_thread::get_id();
      loss.backward();
    });
    std::unordered_set<c10::Stream> forward_streams;
    for (const auto& probe : probes) {
      REQUIRE(probe.forward.has_value());
      REQUIRE(probe.backward.has_value());
      CHECK(*probe.forward != caller);
      // Autograd runs each backward op on the stream its forward op ran on.
      CHECK(*probe.backward == *probe.forward);
      // All on autograd's thread for cuda:0, re-entrant, not on the pool.
      CHECK(probe.thread == probes[0].thread);
      CHECK(probe.thread != backward_caller);
      forward_streams.insert(*probe.forward);
    }
    CHECK(forward_streams.size() == std::size_t(count));
    CHECK(current_stream() == caller);
  }

  TEST_CASE(
      "caller_stream_cuda: called on a stream of its own, the results are the sequential ones" *
      doctest::skip(no_cuda)) {
    torch::manual_seed(4);
    Towers towers(4);
    torch::cuda::synchronize();  // the towers were made on the default stream
    c10::StreamGuard on_side_stream(sw::runtime::new_stream(gpu()));
    check_against_sequential(towers);
  }

  TEST_CASE("error_cuda: an error in a branch's backward reaches the caller; autograd still works" *
            doctest::skip(no_cuda)) {
    torch::manual_seed(5);
    Towers towers(3);
    std::vector<Probe> probes(3);
    probes[1].on_backward = [] { TORCH_CHECK(false, "backward of expert 1 failed"); };
    std::vector<sw::TensorBranch> branches;
    for (int i = 0; i < 3; ++i) {
      branches.push_back([&, i](const torch::Tensor& x) {
        return Probed::apply(towers.nets[i]->forward(x), &probes[i]);
      });
    }
    auto loss = loss_of(sw::parallel_branches(branches, towers.fresh_inputs()));
    bool caught = false;
    finishes_within(limit, "failing backward", [&] {
      try {
        loss.backward();
      } catch (const c10::Error& e) {
        caught = true;
        CHECK(contains(e.what_without_backtrace(), "backward of expert 1 failed"));
      }
    });
    CHECK(caught);
    zero_grads(towers.parameters());
    check_against_sequential(towers);
  }

  TEST_CASE("grad_cuda: torch::autograd::grad through CUDA branches gives the input gradients" *
            doctest::skip(no_cuda)) {
    torch::manual_seed(6);
    Towers towers(2);
    auto seq_inputs = towers.fresh_inputs();
    auto expected = torch::autograd::grad(
        {loss_of({towers.nets[0]->forward(seq_inputs[0]), towers.nets[1]->forward(seq_inputs[1])})},
        seq_inputs);
    auto inputs = towers.fresh_inputs();
    auto loss = loss_of(sw::parallel_branches(towers.branches(), inputs));
    variable_list got;
    finishes_within(limit, "grad", [&] { got = torch::autograd::grad({loss}, inputs); });
    CHECK(all_close(got, expected));
    for (const auto& p : towers.parameters()) CHECK_FALSE(p.grad().defined());
  }

  TEST_CASE(
      "mixed_cuda: CPU branches, CUDA branches and a CPU branch using CUDA inside, in one call" *
      doctest::skip(no_cuda)) {
    torch::manual_seed(7);
    auto cpu_net = mlp(16, 32, 8);
    auto gpu_net = mlp(16, 32, 8);
    gpu_net->to(gpu());
    auto hop_net = mlp(16, 32, 8);  // on the GPU, fed from and back to the CPU
    hop_net->to(gpu());
    std::vector<sw::TensorBranch> branches{
        [&](const torch::Tensor& x) { return cpu_net->forward(x); },
        [&](const torch::Tensor& x) { return gpu_net->forward(x); },
        [&](const torch::Tensor& x) { return hop_net->forward(x.to(gpu())).cpu(); }};
    auto values = std::vector<torch::Tensor>{torch::randn({8, 16}), torch::randn({8, 16}).to(gpu()),
                                             torch::randn({8, 16})};
    std::vector<torch::Tensor> params;
    for (auto* net : {&cpu_net, &gpu_net, &hop_net}) {
      for (auto& p : (*net)->parameters()) params.push_back(p);
    }
    auto inputs_of = [&] {
      std::vector<torch::Tensor> inputs;
      for (const auto& v : values) inputs.push_back(v.clone().requires_grad_(true));
      return inputs;
    };
    auto total = [](const std::vector<torch::Tensor>& outs) {
      return outs[0].pow(2).sum() + outs[1].pow(2).sum().cpu() + outs[2].pow(2).sum() * 3;
    };
    auto seq_inputs = inputs_of();
    std::vector<torch::Tensor> sequential;
    for (std::size_t i = 0; i < branches.size(); ++i) {
      sequential.push_back(branches[i](seq_inputs[i]));
    }
    total(sequential).backward();
    const auto expected_params = grads_of(params);
    const auto expected_inputs = grads_of(seq_inputs);
    zero_grads(params);

    auto inputs = inputs_of();
    auto parallel = sw::parallel_branches(branches, inputs);
    CHECK(all_close(parallel, sequential));
    auto loss = total(parallel);
    finishes_within(limit, "mixed backward", [&] { loss.backward(); });
    CHECK(all_close(grads_of(inputs), expected_inputs));
    CHECK(all_close(grads_of(params), expected_params));
  }

  TEST_CASE("nested_cuda: parallel_branches inside a CUDA branch finishes with the right gradient" *
            doctest::skip(no_cuda)) {
    auto x = torch::randn({3}, torch::TensorOptions().device(gpu())).requires_grad_(true);
    auto inner = [](const torch::Tensor& t) {
      auto outs = sw::parallel_branches({[](const torch::Tensor& u) { return u * 2; },
                                         [](const torch::Tensor& u) { return u * 3; },
                                         [](const torch::Tensor& u) { return u * 4; }},
                                        {t, t, t});
      return outs[0] + outs[1] + outs[2];
    };
    auto outs = sw::parallel_branches({inner, inner, inner}, {x, x, x});
    auto loss = (outs[0] + outs[1] + outs[2]).sum();
    finishes_within(limit, "nested backward", [&] { loss.backward(); });
    CHECK(x.grad().cpu().equal(torch::full({3}, 27.0f)));
  }

  TEST_CASE("module_cuda: ParallelBranches moved to the GPU gives the sequential gradients" *
            doctest::skip(no_cuda)) {
    torch::manual_seed(8);
    std::vector<torch::nn::Sequential> nets{mlp(16, 32, 8), mlp(16, 64, 8), mlp(16, 16, 8)};
    sw::ParallelBranches experts(
        sw::ParallelBranchesOptions().reduction(
            [](const std::vector<torch::Tensor>& outs) { return torch::stack(outs).sum(0); }),
        nets[0], nets[1], nets[2]);
    experts->to(gpu());
    auto value = torch::randn({32, 16}, torch::TensorOptions().device(gpu()));
    auto x = late(value);
    torch::Tensor sequential = torch::zeros({32, 8}, torch::TensorOptions().device(gpu()));
    for (auto& net : nets) sequential = sequential + net->forward(x);
    sequential.pow(2).sum().backward();
    const auto expected = grads_of(experts->parameters());
    const auto expected_x = x.grad().clone();
    zero_grads(experts->parameters());

    auto y = late(value);
    auto out = experts->forward_reduced(y);
    CHECK(torch::allclose(out, sequential, 1e-5, 1e-6));
    auto loss = out.pow(2).sum();
    finishes_within(limit, "module backward", [&] { loss.backward(); });
    CHECK(torch::allclose(y.grad(), expected_x, 1e-5, 1e-6));
    CHECK(all_close(grads_of(experts->parameters()), expected));
  }

  TEST_CASE("autocast_cuda: under autocast the results are the sequential ones under autocast" *
            doctest::skip(no_cuda)) {
    torch::manual_seed(9);
    Towers towers(4);
    check_against_sequential(towers, 1e-2, 1e-3, /*autocast=*/true);
  }
}
