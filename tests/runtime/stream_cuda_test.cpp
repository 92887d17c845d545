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

// Queues a few milliseconds of products on the current stream of `device`, so that work queued
// after it on that stream runs late.
void keep_busy(const torch::Device& device) {
  auto a = torch::randn({2048, 2048}, torch::TensorOptions().device(device));
  for (int i = 0; i < 20; ++i) a = torch::mm(a, a).div_(2048.0);
}
}  // namespace

TEST_SUITE("streams on the CPU") {
  TEST_CASE("CPU streams are the default stream and every operation is a no-op") {
    auto s = sw::runtime::new_stream(torch::kCPU);
    CHECK(s == sw::runtime::current_stream(torch::kCPU));
    sw::runtime::wait_stream(s, s);
    auto x = torch::rand({3});
    sw::runtime::record_stream(x, s);
    CHECK(sw::runtime::copy_to(x, torch::kCPU, s, s, s).is_same(x));
    CHECK(sw::runtime::copy_to(x, torch::kCPU).is_same(x));
    CHECK(!sw::runtime::copy_to(torch::Tensor(), torch::kCPU).defined());
  }
}

TEST_SUITE("streams on CUDA") {
  // copy_to's contract, read at once with no synchronize in between: the result is ready for
  // its target when copy_to returns, and the source may be freed or overwritten right away.
  TEST_CASE("copy_cuda: a GPU-to-CPU copy is complete when copy_to returns" *
            doctest::skip(no_cuda)) {
    const torch::Device gpu(torch::kCUDA, 0);
    auto producer = sw::runtime::new_stream(gpu);
    auto copy = sw::runtime::new_stream(gpu);
    const auto cpu_stream = sw::runtime::current_stream(torch::kCPU);
    for (int round = 0; round < 20; ++round) {
      torch::Tensor x;
      {
        c10::StreamGuard guard(producer);
        keep_busy(gpu);
        x = torch::full({1 << 22}, static_cast<float>(round), torch::TensorOptions().device(gpu));
      }
      // Odd rounds give a copy stream on the GPU; even ones the CPU stage's own (the CPU's), for
      // which copy_to takes a stream of the GPU side itself.
      const c10::Stream via = round % 2 == 1 ? c10::Stream(copy) : cpu_stream;
      auto y = sw::runtime::copy_to(x, torch::kCPU, producer, via, cpu_stream);
      x = torch::Tensor();  // freed at once; its block may be handed out again
      {
        c10::StreamGuard guard(producer);
        auto reuse = torch::full({1 << 22}, -1.0f, torch::TensorOptions().device(gpu));
        (void)reuse;
      }
      INFO("round " << round);
      CHECK(y.device() == torch::Device(torch::kCPU));
      CHECK(y.eq(static_cast<float>(round)).all().item<bool>());  // no synchronize before this
    }
  }

  // The control for the case above: the same reads after a plain non-blocking copy to the CPU,
  // the copy the pipe made before copy_to. It returns pinned memory that the GPU fills later, so
  // reading it at once sees stale data; this shows the case above would catch that.
  TEST_CASE("copy_cuda: control: a plain non-blocking GPU-to-CPU copy is read before it lands" *
            doctest::skip(no_cuda)) {
    const torch::Device gpu(torch::kCUDA, 0);
    auto producer = sw::runtime::new_stream(gpu);
    int stale = 0;
    for (int round = 0; round < 20; ++round) {
      torch::Tensor y;
      {
        c10::StreamGuard guard(producer);
        keep_busy(gpu);
        auto x =
            torch::full({1 << 22}, static_cast<float>(round), torch::TensorOptions().device(gpu));
        y = x.to(torch::kCPU, /*non_blocking=*/true);
      }
      stale += y.eq(static_cast<float>(round)).all().item<bool>() ? 0 : 1;
      producer.synchronize();
    }
    MESSAGE(stale << " of 20 plain non-blocking copies were read before they landed");
    CHECK(stale > 0);
  }

  TEST_CASE("copy_cuda: a CPU-to-GPU copy keeps the source's values when it is overwritten" *
            doctest::skip(no_cuda)) {
    const torch::Device gpu(torch::kCUDA, 0);
    auto copy = sw::runtime::new_stream(gpu);
    auto consumer = sw::runtime::new_stream(gpu);
    const auto cpu_stream = sw::runtime::current_stream(torch::kCPU);
    for (const bool pinned : {true, false}) {
      auto source = torch::full({1 << 22}, 3.0f);
      if (pinned) source = source.pin_memory();
      {
        c10::StreamGuard guard(copy);
        keep_busy(gpu);  // the copy waits behind this: a late DMA would read the -1s below
      }
      auto y = sw::runtime::copy_to(source, gpu, cpu_stream, copy, consumer);
      source.fill_(-1.0f);
      float sum = 0;
      {
        // On the consumer stream, which copy_to made wait for the copy; item() reads the sum on
        // that stream too (pool streams do not wait for the default stream, nor it for them).
        c10::StreamGuard guard(consumer);
        sum = y.sum().item<float>();
      }
      INFO("pinned " << pinned);
      CHECK(sum == 3.0f * static_cast<float>(1 << 22));
    }
  }

  TEST_CASE("copy_cuda: on one GPU the target stream waits for the producer's" *
            doctest::skip(no_cuda)) {
    const torch::Device gpu(torch::kCUDA, 0);
    auto producer = sw::runtime::new_stream(gpu);
    auto consumer = sw::runtime::new_stream(gpu);
    torch::Tensor x;
    {
      c10::StreamGuard guard(producer);
      keep_busy(gpu);
      x = torch::full({1 << 22}, 5.0f, torch::TensorOptions().device(gpu));
    }
    auto y = sw::runtime::copy_to(x, gpu, producer, consumer, consumer);
    CHECK(y.is_same(x));
    float sum = 0;
    {
      c10::StreamGuard guard(consumer);
      sum = y.sum().item<float>();  // summed and read on the consumer stream
    }
    CHECK(sum == 5.0f * static_cast<float>(1 << 22));
  }

  TEST_CASE("pipe_cuda: gradients across two GPUs equal the CPU model's" *
            doctest::skip(fewer_than_two)) {
    torch::manual_seed(0);
    torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    auto x = torch::randn({8, 4});
    seq->forward(x).sum().backward();
    auto expected = seq[0]->parameters()[0].grad().clone();
    seq->zero_grad();
    auto pipe = sw::Pipe(seq, sw::balance{1, 1},
                         sw::PipeOptions().chunks(4).devices(
                             {torch::Device(torch::kCUDA, 0), torch::Device(torch::kCUDA, 1)}));
    pipe->forward(x.to(torch::Device(torch::kCUDA, 0))).sum().backward();
    CHECK(torch::allclose(seq[0]->parameters()[0].grad().cpu(), expected, 1e-5, 1e-6));
  }
}
