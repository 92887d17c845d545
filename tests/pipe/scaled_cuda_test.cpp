// fp16 on CUDA with amp::GradScaler: CUDA autocast (fp16) carried through the stage workers and
// the recomputes, each micro-batch's loss scaled, LibTorch's CUDA kernels unscaling and updating
// the scale on the GPU; the gradients, skips and scales equal the unpipelined model's under the
// same autocast and scaler. Compiles everywhere; skipped without a GPU.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include <torch/cuda.h>
#include <torch/torch.h>

#include "tests/support/autocast.hpp"

#include <doctest/doctest.h>

#include <limits>
#include <set>
#include <vector>

namespace sw = stagewise;

namespace {

const bool no_cuda_here = !torch::cuda::is_available();

// CUDA autocast (fp16, its default dtype) for its lifetime.
struct CudaAutocast {
  CudaAutocast() { sw::testing::set_cuda_autocast(true); }
  ~CudaAutocast() {
    sw::testing::set_cuda_autocast(false);
    at::autocast::clear_cache();
  }
  CudaAutocast(const CudaAutocast&) = delete;
  CudaAutocast& operator=(const CudaAutocast&) = delete;
};

torch::nn::Sequential gpu_model() {
  torch::manual_seed(3);
  torch::nn::Sequential seq(torch::nn::Linear(64, 128), torch::nn::ReLU(),
                            torch::nn::Linear(128, 128), torch::nn::Tanh(),
                            torch::nn::Linear(128, 16));
  seq->to(torch::Device(torch::kCUDA, 0));
  return seq;
}

double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  const auto g = got.detach().to(torch::kCPU, torch::kDouble);
  const auto w = want.detach().to(torch::kCPU, torch::kDouble);
  return (g - w).norm().item<double>() / std::max(w.norm().item<double>(), 1e-30);
}

// The loss in fp32 (autocast's mse_loss runs in fp32); at a bad step it overflows.
torch::Tensor loss_of(const torch::Tensor& o, const torch::Tensor& t, bool bad) {
  auto l = torch::mse_loss(o.to(torch::kFloat), t);
  return bad ? l + o.to(torch::kFloat).sum() * std::numeric_limits<float>::infinity() : l;
}

}  // namespace

TEST_SUITE("fp16 on CUDA with a GradScaler") {
  TEST_CASE("cuda: scaled fp16 steps through workers and recomputes equal the unpipelined model" *
            doctest::skip(no_cuda_here)) {
    const torch::Device gpu(torch::kCUDA, 0);
    CHECK(sw::detail::amp_kernels_on(gpu));  // LibTorch's own unscale and update kernels
    auto seq = gpu_model(), ref = gpu_model();
    auto pipe = sw::Pipe(seq, sw::balance{3, 3},
                         sw::PipeOptions().chunks(4).checkpoint("always").devices({gpu, gpu}));
    torch::optim::Adam opt(pipe->parameters(), torch::optim::AdamOptions(1e-3));
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-3));
    const auto options = sw::amp::GradScalerOptions().growth_interval(2);
    sw::amp::GradScaler scaler(options), ref_scaler(options);
    const std::set<int> bad = {1, 2};
    for (int step = 0; step < 5; ++step) {
      CAPTURE(step);
      torch::manual_seed(40 + step);
      const auto x = torch::randn({32, 64}, gpu), t = torch::randn({32, 16}, gpu);
      const bool overflow = bad.count(step) > 0;
      auto f = [overflow](const torch::Tensor& o, const torch::Tensor& y) {
        return loss_of(o, y, overflow);
      };
      torch::manual_seed(7);
      {
        CudaAutocast region;
        pipe->train_step(x, t, f, scaler, sw::schedule::one_f_one_b{});
      }
      torch::manual_seed(7);
      {
        CudaAutocast region;
        auto xs = x.chunk(4), ts = t.chunk(4);
        for (std::size_t i = 0; i < xs.size(); ++i) {
          ref_scaler.scale(f(ref->forward(xs[i]), ts[i]) * 0.25).backward();
        }
      }
      const auto got = pipe->parameters(), want = ref->parameters();
      for (std::size_t k = 0; k < got.size(); ++k) {
        CHECK(got[k].grad().dtype() == torch::kFloat);
        if (!overflow) CHECK(relative_error(got[k].grad(), want[k].grad()) < 1e-5);
      }
      CHECK(scaler.step(opt) == !overflow);
      CHECK(ref_scaler.step(ref_opt) == !overflow);
      scaler.update();
      ref_scaler.update();
      CHECK(scaler.get_scale() == ref_scaler.get_scale());
      opt.zero_grad();
      ref_opt.zero_grad();
    }
    CHECK(scaler.get_scale() == 65536.0 / 4 * 2);  // two backoffs, then one growth
  }

  TEST_CASE("cuda: the fused step under the scaler (ZB-H1, clipped) equals the unfused one" *
            doctest::skip(no_cuda_here)) {
    const torch::Device gpu(torch::kCUDA, 0);
    auto a = gpu_model(), b = gpu_model();
    const auto pipe_options = sw::PipeOptions().chunks(4).devices({gpu, gpu});
    auto fused_pipe = sw::Pipe(a, sw::balance{3, 3}, pipe_options);
    auto plain_pipe = sw::Pipe(b, sw::balance{3, 3}, pipe_options);
    sw::optim::FusedStep fused(fused_pipe->parameters(), torch::optim::AdamOptions(1e-3));
    torch::optim::Adam plain(plain_pipe->parameters(), torch::optim::AdamOptions(1e-3));
    sw::amp::GradScaler fs, ps;
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(60 + step);
      const auto x = torch::randn({32, 64}, gpu), t = torch::randn({32, 16}, gpu);
      auto f = [bad = step == 1](const torch::Tensor& o, const torch::Tensor& y) {
        return loss_of(o, y, bad);
      };
      torch::manual_seed(9);
      {
        CudaAutocast region;
        fused_pipe->clip_grad_norm_step(
            fused, [&] { fused_pipe->train_step(x, t, f, fused, fs, sw::schedule::zero_bubble_h1{}); },
            1.0, fs);
      }
      torch::manual_seed(9);
      {
        CudaAutocast region;
        plain_pipe->train_step(x, t, f, ps, sw::schedule::zero_bubble_h1{});
      }
      ps.unscale_(plain);
      torch::nn::utils::clip_grad_norm_(plain_pipe->parameters(), 1.0);
      ps.step(plain);
      plain.zero_grad();
      fs.update();
      ps.update();
      CHECK(fs.get_scale() == ps.get_scale());
    }
    const auto pa = a->parameters(), pb = b->parameters();
    for (std::size_t k = 0; k < pa.size(); ++k) CHECK(relative_error(pa[k], pb[k]) < 1e-6);
  }
}
