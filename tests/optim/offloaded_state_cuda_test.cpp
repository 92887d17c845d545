// Optimizer state off a GPU (skipped without one): the fused and the unfused step with their state
// in a HostStore or a FileStore equal the step on the GPU within the difference between the CPU's
// and the GPU's arithmetic (the host step is Adam on CPU tensors; a few units in the last place a
// step), with the GPU stalled before each backward so that a gradient copied before the kernel
// that writes it, or a value read back before its copy lands, would show as a large difference.
#include <stagewise/stagewise.hpp>

#if defined(STAGEWISE_WITH_CUDA)
#include <ATen/cuda/Sleep.h>
#endif
#include <torch/cuda.h>
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sw = stagewise;

namespace {
const bool no_cuda = !torch::cuda::is_available();

// Holds the current stream for tens of milliseconds (at::cuda::sleep where the CUDA build has it,
// else a few milliseconds of products), so that what is queued next runs that much later.
void stall(const torch::Device& device) {
#if defined(STAGEWISE_WITH_CUDA)
  (void)device;
  at::cuda::sleep(int64_t{1} << 26);
#else
  auto a = torch::randn({2048, 2048}, torch::TensorOptions().device(device));
  for (int i = 0; i < 10; ++i) a = torch::mm(a, a).div_(2048.0);
#endif
}

torch::nn::Sequential model(const torch::Device& device) {
  torch::manual_seed(3);
  torch::nn::Sequential m(torch::nn::Linear(256, 512), torch::nn::Tanh(),
                          torch::nn::Linear(512, 256));
  m->to(device);
  return m;
}

// Five steps on the GPU, fused or not, with the state on the GPU (store: none) or in `store`.
std::vector<torch::Tensor> train(std::optional<sw::runtime::AnyStore> store, bool fused) {
  const torch::Device gpu(torch::kCUDA, 0);
  auto m = model(gpu);
  const auto adam = torch::optim::AdamOptions(1e-2);
  std::unique_ptr<sw::optim::FusedStep> f;
  std::unique_ptr<torch::optim::Optimizer> u;
  if (fused) {
    f = std::make_unique<sw::optim::FusedStep>(m->named_parameters(), adam);
    if (store) f->offload_state(sw::runtime::OffloadedState(*store));
  } else if (store) {
    u = std::make_unique<sw::optim::OffloadedOptimizer>(m->named_parameters(), adam,
                                                        sw::runtime::OffloadedState(*store));
  } else {
    u = std::make_unique<torch::optim::Adam>(m->parameters(), adam);
  }
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(10 + step);
    const auto x = torch::randn({64, 256}).to(gpu), y = torch::randn({64, 256}).to(gpu);
    auto loss = torch::mse_loss(m->forward(x), y);
    stall(gpu);  // the backward's kernels, the gradients' included, run late
    loss.backward();
    if (f) {
      f->finish_step();
    } else {
      u->step();
      for (auto& p : m->parameters()) p.mutable_grad().reset();
    }
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : m->parameters()) out.push_back(p.detach().cpu());
  return out;
}

void check_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    CAPTURE(k);
    const double diff = (got[k] - want[k]).abs().max().item<double>();
    MESSAGE("parameter " << k << ": largest difference from the step on the GPU " << diff);
    CHECK(torch::allclose(got[k], want[k], /*rtol=*/1e-5, /*atol=*/1e-6));
  }
}

std::string fresh_dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(base ? base : "/tmp") + "/stagewise_state_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}
}  // namespace

TEST_SUITE("optimizer state off a GPU") {
  TEST_CASE("offloaded_state_cuda: fused and unfused equal the step on the GPU within rounding" *
            doctest::skip(no_cuda)) {
    for (bool fused : {true, false}) {
      CAPTURE(fused);
      const auto want = train(std::nullopt, fused);
      check_close(train(sw::runtime::HostStore(), fused), want);
      check_close(train(sw::runtime::FileStore(fresh_dir("cuda")), fused), want);
    }
  }
}
