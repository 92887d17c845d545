// Compile-only (tools/cuda_compile_check.sh, never linked or run): the library's device-generic
// code paths driven with CUDA's own types (streams, events, guards, generators) against the
// c10/cuda and ATen/cuda headers and the CUDA toolkit's, so a GPU path that no longer
// type-checks fails here even on a machine without a GPU.
#include "stagewise/stagewise.hpp"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include <vector>

namespace sw = stagewise;

namespace cuda_paths {

// runtime/stream.hpp: CUDA streams convert to and from the device-generic c10::Stream it takes.
torch::Tensor copy_between_streams(const torch::Tensor& x) {
  const torch::Device gpu(torch::kCUDA, 0);
  c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(0);
  c10::cuda::CUDAStream copy = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  sw::runtime::wait_stream(copy, compute);
  torch::Tensor y = sw::runtime::copy_to(x, gpu, compute, copy, compute);
  sw::runtime::record_stream(y, copy);
  const c10::cuda::CUDAStream pooled(sw::runtime::new_stream(gpu));
  const c10::cuda::CUDAStream current(sw::runtime::current_stream(gpu));
  {
    c10::cuda::CUDAStreamGuard guard(pooled);
    at::cuda::CUDAEvent done;
    done.record(pooled);
    done.block(current);
  }
  return y;
}

// core/rng.hpp: a snapshot of the CUDA generator next to the CPU one.
torch::Tensor replay_dropout(const torch::Tensor& x) {
  const torch::Device gpu(torch::kCUDA, 0);
  c10::cuda::CUDAGuard on_gpu(gpu);
  const sw::RngState snapshot = sw::RngState::capture(gpu);
  torch::Tensor first = torch::dropout(x, 0.5, /*train=*/true);
  sw::RngState::Restore replay(snapshot);
  at::Generator cuda_generator = at::cuda::detail::getDefaultCUDAGenerator(0);
  (void)cuda_generator.current_seed();
  return first - torch::dropout(x, 0.5, /*train=*/true);
}

// pipe.hpp: a pipeline over two GPUs, forward and a training step.
torch::Tensor pipe_on_two_gpus(const torch::Tensor& x, const torch::Tensor& y) {
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  auto pipe = sw::Pipe(model, sw::balance{2, 1},
                       sw::PipeOptions().chunks(4).devices(
                           {torch::Device(torch::kCUDA, 0), torch::Device(torch::kCUDA, 1)}));
  auto loss = pipe->train_step(x, y, [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, target);
  });
  return pipe->forward(x.to(torch::Device(torch::kCUDA, 0))) + loss;
}

}  // namespace cuda_paths
