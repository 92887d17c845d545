// Saves across devices: a pipe with a stage on the CPU and one on the GPU saves, and a pipe of
// another split with every stage on the GPU (or on the CPU) loads it: each parameter, buffer and
// optimizer state lands on the device of the stage that now holds it, and training goes on as the
// saving pipe goes on (within float tolerance: the GPU's kernels sum in their own order).
// Compiles everywhere; skipped without a GPU.
#include "stagewise/pipe.hpp"
#include "stagewise/pipe/save_info.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace fs = std::filesystem;

namespace {

const bool no_cuda_here = !torch::cuda::is_available();

torch::nn::Sequential model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16),
                               torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 4));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t.to(y.device()));
}

void step(sw::Pipe<>& pipe, torch::optim::Adam& adam, int s) {
  torch::manual_seed(50 + s);
  const auto x = torch::randn({16, 8}), y = torch::randn({16, 4});
  adam.zero_grad();
  pipe->train_step(x, y, mse, sw::schedule::one_f_one_b{});
  adam.step();
}

std::vector<torch::Tensor> on_cpu(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().cpu());
  for (const auto& b : m.buffers()) out.push_back(b.detach().cpu());
  return out;
}

}  // namespace

TEST_SUITE("saves across devices") {
  TEST_CASE("cuda: a save of a CPU + GPU pipe loads into another split on the GPU and on the CPU" *
            doctest::skip(no_cuda_here)) {
    const char* tmp = std::getenv("TEST_TMPDIR");
    const auto dir = fs::path(tmp ? tmp : "/tmp") / ("save_cuda_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    const torch::Device cpu(torch::kCPU), gpu(torch::kCUDA, 0);
    auto saving = sw::Pipe<>(model(1), sw::balance{3, 3},
                             sw::PipeOptions().chunks(4).checkpoint("never").devices({cpu, gpu}));
    torch::optim::Adam adam(saving->parameters(), torch::optim::AdamOptions(1e-2));
    for (int s = 0; s < 2; ++s) step(saving, adam, s);
    saving->save(dir.string(), adam, 1);
    step(saving, adam, 2);
    const auto want = on_cpu(*saving);

    for (const auto& device : {gpu, cpu}) {
      CAPTURE(device.str());
      auto loading =
          sw::Pipe<>(model(2), sw::balance{2, 4},
                     sw::PipeOptions().chunks(4).checkpoint("never").devices({device, device}));
      torch::optim::Adam other(loading->parameters(), torch::optim::AdamOptions(1e-2));
      CHECK(loading->load(dir.string(), other) == 1);
      for (const auto& p : loading->parameters()) {
        const auto& state = static_cast<torch::optim::AdamParamState&>(
            *other.state().at(sw::detail::optimizer_state_key(p)));
        CHECK(state.exp_avg().device() == p.device());
        CHECK(state.exp_avg_sq().device() == p.device());
      }
      step(loading, other, 2);
      const auto got = on_cpu(*loading);
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        CAPTURE(i);
        CHECK(torch::allclose(got[i].to(torch::kDouble), want[i].to(torch::kDouble), 1e-4, 1e-5));
      }
    }
  }
}
