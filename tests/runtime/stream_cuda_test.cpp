#include "stagewise/pipe.hpp"
#include "stagewise/runtime/stream.hpp"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <chrono>
#include <thread>

namespace sw = stagewise;

namespace {
const bool no_cuda = !torch::cuda::is_available();
const bool fewer_than_two = torch::cuda::device_count() < 2;
}  // namespace

TEST_SUITE("streams on the CPU") {
  TEST_CASE("CPU streams are the default stream and every operation is a no-op") {
    auto s = sw::runtime::new_stream(torch::kCPU);
    CHECK(s == sw::runtime::default_stream(torch::kCPU));
    sw::runtime::wait_stream(s, s);
    auto x = torch::rand({3});
    sw::runtime::record_stream(x, s);
    CHECK(sw::runtime::copy_to(x, torch::kCPU, s, s, s).is_same(x));
  }
}

TEST_SUITE("streams on CUDA") {
  TEST_CASE("copy_cuda: data arrives intact through a copy stream with a delayed producer" *
            doctest::skip(no_cuda)) {
    const torch::Device gpu(torch::kCUDA, 0);
    auto producer = sw::runtime::new_stream(gpu);
    auto copy = sw::runtime::new_stream(gpu);
    auto consumer = sw::runtime::new_stream(gpu);
    torch::Tensor x;
    {
      c10::StreamGuard guard(producer);
      torch::cuda::synchronize();
      x = torch::ones({1 << 20}, torch::TensorOptions().device(gpu));
      for (int i = 0; i < 50; ++i) x = x * 1.0 + 0.0;  // keep the producer busy
      x.add_(1);
    }
    auto y = sw::runtime::copy_to(x, torch::kCPU, producer, copy, consumer);
    torch::cuda::synchronize();
    CHECK(y.eq(2).all().item<bool>());
  }

  TEST_CASE("pipe_cuda: gradients across two GPUs equal the CPU model's" * doctest::skip(fewer_than_two)) {
    torch::manual_seed(0);
    torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    auto x = torch::randn({8, 4});
    seq->forward(x).sum().backward();
    auto expected = seq[0]->parameters()[0].grad().clone();
    seq->zero_grad();
    auto pipe = sw::Pipe(seq, sw::balance{1, 1},
                         sw::PipeOptions().chunks(4).devices({torch::Device(torch::kCUDA, 0),
                                                              torch::Device(torch::kCUDA, 1)}));
    pipe->forward(x.to(torch::Device(torch::kCUDA, 0))).sum().backward();
    CHECK(torch::allclose(seq[0]->parameters()[0].grad().cpu(), expected, 1e-5, 1e-6));
  }
}
