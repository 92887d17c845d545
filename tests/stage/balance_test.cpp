#include "stagewise/stage/balance.hpp"
#include "stagewise/pipe.hpp"
#include "stagewise/skip/skippable.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <thread>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

// Sleeps in forward: a layer of known time.
struct SleepImpl : torch::nn::Cloneable<SleepImpl> {
  explicit SleepImpl(int ms = 0) : ms(ms) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return x;
  }
  int ms;
};
TORCH_MODULE(Sleep);

// Keeps `copies` times its input alive: a layer of known activation memory.
struct WidenImpl : torch::nn::Cloneable<WidenImpl> {
  explicit WidenImpl(int64_t copies = 1) : copies(copies) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) { return x.repeat({1, copies}); }
  int64_t copies;
};
TORCH_MODULE(Widen);

// x * w with w of 16 floats: 64 bytes of parameters, an output as large as its input.
struct ScaleImpl : torch::nn::Cloneable<ScaleImpl> {
  ScaleImpl() { reset(); }
  void reset() override { w = register_parameter("w", torch::ones({16})); }
  torch::Tensor forward(torch::Tensor x) { return x * w; }
  torch::Tensor w;
};
TORCH_MODULE(Scale);

// Not Cloneable, and changes a buffer in forward: profiled in place, then put back.
struct CounterImpl : torch::nn::Module {
  CounterImpl() : calls(register_buffer("calls", torch::zeros({1}))) {}
  torch::Tensor forward(torch::Tensor x) {
    calls.add_(1);
    return x;
  }
  torch::Tensor calls;
};
TORCH_MODULE(Counter);

struct Ns {};
using skip_x = sw::skip<Ns, "x">;
// Stashes its input and sleeps; a later layer pops it.
struct StashImpl : sw::Skippable<StashImpl, sw::stashes<skip_x>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<skip_x>(x);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    return x * 2;
  }
};
TORCH_MODULE(Stash);
struct PopImpl : sw::Skippable<PopImpl, sw::pops<skip_x>> {
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    return (x + pop<skip_x>()).relu_();  // in place on its own result
  }
};
TORCH_MODULE(Pop);

torch::nn::Sequential sleepy() {
  torch::nn::Sequential model;
  for (int ms : {10, 20, 30, 40, 50, 60}) model->push_back(Sleep(ms));
  return model;
}

}  // namespace

TEST_SUITE("balance") {
  TEST_CASE("balance by time on layers that sleep 10..60 ms gives [4, 2]") {
    auto model = sleepy();
    const auto b = sw::balance_by_time(2, model, torch::rand({1}), sw::BalanceOptions().rounds(1));
    CHECK(b == sw::balance{4, 2});
    const auto times = sw::profile_times(model, torch::rand({1}), sw::BalanceOptions().rounds(1));
    REQUIRE(times.size() == 6);
    for (std::size_t i = 0; i < 6; ++i) CHECK(times[i] >= 0.010 * static_cast<double>(i + 1));
  }

  TEST_CASE("the balance plugs into Pipe") {
    // One best split by 20 ms (40 | 40 against 20 | 60 and 80 | 0), whatever the Linears' few
    // microseconds measure (a split of tiny layers around one slow one is a tie that load
    // decides).
    torch::nn::Sequential model(torch::nn::Linear(8, 64), Sleep(20), Sleep(20), Sleep(40),
                                torch::nn::Linear(64, 4));
    const auto b =
        sw::balance_by_time(2, model, torch::randn({4, 8}), sw::BalanceOptions().rounds(1));
    CHECK(b == sw::balance{3, 2});
    auto pipe = sw::Pipe(model, b, sw::PipeOptions().chunks(2));
    CHECK(pipe->forward(torch::randn({4, 8})).sizes() == torch::IntArrayRef{4, 4});
  }

  TEST_CASE("profiling leaves parameters, buffers, gradients, mode and device untouched") {
    torch::manual_seed(0);
    // Every layer Cloneable: profiled on copies.
    torch::nn::Sequential model(
        torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8), torch::nn::Dropout(0.5),
        torch::nn::ReLU(torch::nn::ReLUOptions(true)), torch::nn::Linear(8, 2));
    model->eval();
    model[4]->train();  // a mix of modes, kept as it is
    std::vector<torch::Tensor> params, buffers;
    for (const auto& p : model->parameters()) params.push_back(p.clone());
    for (const auto& b : model->buffers()) buffers.push_back(b.clone());
    const auto bn_mean = model->named_buffers()["1.running_mean"];
    for (auto by_size : {false, true}) {
      CAPTURE(by_size);
      const auto b = by_size ? sw::balance_by_size(3, model, torch::randn({5, 4}))
                             : sw::balance_by_time(3, model, torch::randn({5, 4}),
                                                   sw::BalanceOptions().rounds(2));
      CHECK(b.size() == 3);
      const auto now_params = model->parameters();
      for (std::size_t k = 0; k < params.size(); ++k) {
        CHECK(now_params[k].equal(params[k]));
        CHECK(!now_params[k].grad().defined());
        CHECK(now_params[k].device().is_cpu());
      }
      const auto now_buffers = model->buffers();
      for (std::size_t k = 0; k < buffers.size(); ++k) CHECK(now_buffers[k].equal(buffers[k]));
      CHECK(model->named_buffers()["1.running_mean"].is_same(bn_mean));
      CHECK(!model->is_training());
      CHECK(!model[1]->is_training());
      CHECK(!model[3]->is_training());
      CHECK(model[4]->is_training());
    }
  }

  TEST_CASE("a model that cannot be copied is profiled in place and put back") {
    torch::nn::Sequential model(Counter(), torch::nn::Linear(4, 4), Counter());
    model->eval();
    const auto b =
        sw::balance_by_time(2, model, torch::randn({3, 4}), sw::BalanceOptions().rounds(1));
    CHECK(b.size() == 2);
    CHECK(model[0]->named_buffers()["calls"].item<float>() == 0);
    CHECK(model[2]->named_buffers()["calls"].item<float>() == 0);
    CHECK(!model->parameters()[0].grad().defined());
    CHECK(!model[1]->is_training());
    const auto moved = error_of([&] {
      sw::profile_times(model, torch::randn({3, 4}), sw::BalanceOptions().device(torch::kCUDA));
    });
    CHECK(contains(moved, "the model cannot be copied to cuda for profiling"));
    CHECK(contains(moved, "or make its layers torch::nn::Cloneable"));
  }

  TEST_CASE("a parameter that already has a gradient is an error") {
    torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    model->forward(torch::randn({2, 4})).sum().backward();
    const auto message = error_of([&] { sw::balance_by_time(2, model, torch::randn({2, 4})); });
    CHECK(
        contains(message, "stagewise::profile_times: parameter '0.weight' already has a gradient"));
    CHECK(contains(message, "model->zero_grad(/*set_to_none=*/true)"));
    CHECK(contains(error_of([&] {
                     sw::balance_by_size(2, model, torch::randn({2, 4}));
                   }),
                   "stagewise::profile_sizes: parameter '0.weight' already has a gradient"));
  }

  TEST_CASE("layers that stash and pop skips are profiled in order, with in-place ops") {
    // Costs about 0, 0, 30, 30, 30, 30 ms: the stash lands in stage 0, the pop in stage 1.
    torch::nn::Sequential model(torch::nn::Linear(4, 4),
                                torch::nn::ReLU(torch::nn::ReLUOptions(true)), Stash(), Sleep(30),
                                Pop(), Sleep(30));
    const auto b =
        sw::balance_by_time(2, model, torch::randn({3, 4}), sw::BalanceOptions().rounds(1));
    CHECK(b == sw::balance{4, 2});
    const auto sizes = sw::profile_sizes(model, torch::randn({3, 4}));
    CHECK(sizes.size() == 6);
    for (const auto& p : model->parameters()) CHECK(!p.grad().defined());
    auto pipe = sw::Pipe(model, b, sw::PipeOptions().chunks(3));
    CHECK(pipe->forward(torch::randn({3, 4})).sizes() == torch::IntArrayRef{3, 4});
  }

  TEST_CASE("balance by size counts activations and parameters on the CPU") {
    // Sample 8 x 16 floats = 512 bytes.
    torch::nn::Sequential head(Widen(1), Widen(4), Widen(2));
    const auto sizes = sw::profile_sizes(head, torch::randn({8, 16}));
    CHECK(sizes == std::vector<double>{512, 2048, 4096});
    const auto scaled = sw::profile_sizes(torch::nn::Sequential(Scale()), torch::randn({8, 16}),
                                          sw::BalanceOptions().param_scale(3));
    CHECK(scaled == std::vector<double>{512 + 3 * 64});
    CHECK(sw::balance_by_size(2, head, torch::randn({8, 16})) == sw::balance{2, 1});
  }

#if defined(STAGEWISE_WITH_CUDA)
  // Built against a CUDA LibTorch (CMake defines STAGEWISE_WITH_CUDA there by itself; Bazel with
  // --define=stagewise_cuda=1): sizes on a GPU come from the caching allocator's statistics.
  TEST_CASE("balance by size on CUDA counts activations and parameters from the allocator" *
            doctest::skip(!torch::cuda::is_available())) {
    // Sample 8 x 16 floats = 512 bytes: each output is a multiple of 512 bytes, the caching
    // allocator's smallest block, so its byte counts are exact.
    torch::nn::Sequential head(Widen(1), Widen(4), Widen(2));
    const auto on_gpu = sw::BalanceOptions().device(torch::kCUDA);
    const auto sizes = sw::profile_sizes(head, torch::randn({8, 16}), on_gpu);
    CHECK(sizes == std::vector<double>{512, 2048, 4096});
    CHECK(sw::balance_by_size(2, head, torch::randn({8, 16}), on_gpu) == sw::balance{2, 1});
    const auto scaled = sw::profile_sizes(torch::nn::Sequential(Scale()), torch::randn({8, 16}),
                                          sw::BalanceOptions().device(torch::kCUDA).param_scale(3));
    CHECK(scaled == std::vector<double>{512 + 3 * 64});
    // A model already on the GPU is profiled there by default, and stays there.
    torch::nn::Sequential model(torch::nn::Linear(16, 16), Widen(4), torch::nn::Linear(64, 4));
    model->to(torch::kCUDA);
    const auto b = sw::balance_by_size(2, model, torch::randn({8, 16}));
    CHECK(b.size() == 2);
    for (const auto& p : model->parameters()) {
      CHECK(p.device().is_cuda());
      CHECK(!p.grad().defined());
    }
  }
#else
  TEST_CASE("sizes on CUDA without the caching allocator's statistics are a clear error") {
    torch::nn::Sequential model(Widen(1), Widen(2));
    const auto message = error_of([&] {
      sw::profile_sizes(model, torch::randn({2, 2}), sw::BalanceOptions().device(torch::kCUDA));
    });
    CHECK(contains(message, "build with -DSTAGEWISE_WITH_CUDA against a CUDA LibTorch"));
  }
#endif

  TEST_CASE("partitions < 1, more partitions than layers and a bad sample are errors") {
    auto model = sleepy();
    CHECK(contains(error_of([&] { sw::balance_by_time(0, model, torch::rand({1})); }),
                   "stagewise::balance_by_time: partitions must be at least 1, got 0"));
    CHECK(contains(error_of([&] { sw::balance_by_size(7, model, torch::rand({1})); }),
                   "stagewise::balance_by_size: cannot split 6 layers into 7 partitions; every "
                   "stage needs a layer, so use at most 6 partitions"));
    CHECK(contains(error_of([&] { sw::balance_by_time(2, model, torch::Tensor()); }),
                   "tensor 0 of the sample is undefined"));
    CHECK(contains(error_of([&] { sw::balance_by_time(2, model, torch::tensor(1.0)); }),
                   "tensor 0 of the sample has shape []; give a batch with at least one row"));
    torch::nn::Sequential linear(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    const auto wrong = error_of([&] { sw::balance_by_time(2, linear, torch::randn({2, 3})); });
    CHECK(contains(wrong,
                   "stagewise::profile_times: layer 0 (torch::nn::LinearImpl) failed on the "
                   "sample: "));
    CHECK(contains(wrong, "Give a sample the model accepts"));
  }
}
