#include "stagewise/pipe.hpp"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sw = stagewise;

namespace {

void set_cpu_autocast(bool enabled) {
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 4)
  at::autocast::set_cpu_enabled(enabled);
#else
  at::autocast::set_autocast_enabled(at::kCPU, enabled);
#endif
}

// CPU autocast (bf16, the default CPU dtype) for its lifetime; like leaving an autocast region,
// clears this thread's cast cache at the end.
struct CpuAutocast {
  CpuAutocast() { set_cpu_autocast(true); }
  ~CpuAutocast() {
    set_cpu_autocast(false);
    at::autocast::clear_cache();
  }
};

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out.to(torch::kFloat), target);
}

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

// The unpipelined model on the same micro-batches: all forwards, then the backwards in reverse.
void reference_step(torch::nn::SequentialImpl& seq, const torch::Tensor& x, const torch::Tensor& t,
                    int64_t chunks) {
  auto xs = x.chunk(chunks);
  auto ts = t.chunk(chunks);
  std::vector<torch::Tensor> losses;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double w = static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0));
    losses.push_back(mse(seq.forward(xs[i]), ts[i]) * w);
  }
  for (auto it = losses.rbegin(); it != losses.rend(); ++it) it->backward();
}

void check_same(torch::nn::Module& a, torch::nn::Module& b, const std::string& what) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  for (std::size_t k = 0; k < pa.size(); ++k) {
    INFO(what << ", parameter " << k);
    REQUIRE(pa[k].grad().defined());
    CHECK(pa[k].grad().dtype() == pb[k].grad().dtype());
    CHECK(pa[k].grad().equal(pb[k].grad()));
    CHECK(pa[k].equal(pb[k]));
  }
}

}  // namespace

TEST_SUITE("autocast") {
  TEST_CASE(
      "checkpoint never under CPU bf16 autocast: every step equals the unpipelined model, "
      "across optimizer steps") {
    torch::manual_seed(0);
    auto seq = mlp();
    auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
    auto pipe = sw::Pipe(seq, sw::balance{2, 3}, sw::PipeOptions().chunks(2).checkpoint("never"));
    torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.5));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
    const auto x = torch::randn({4, 6});
    const auto t = torch::randn({4, 3});
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      {
        CpuAutocast autocast;
        pipe->train_step(x, t, mse);
      }
      {
        CpuAutocast autocast;
        reference_step(*ref, x, t, 2);
      }
      check_same(*pipe, *ref, "train_step " + std::to_string(step));
      opt.step();
      ref_opt.step();
    }
  }

  TEST_CASE(
      "checkpoint never under CPU bf16 autocast: forward() after an optimizer step equals "
      "the unpipelined model") {
    torch::manual_seed(1);
    auto seq = mlp();
    auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
    auto pipe = sw::Pipe(seq, sw::balance{2, 3}, sw::PipeOptions().chunks(2).checkpoint("never"));
    torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.5));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
    const auto x = torch::randn({4, 6});
    const auto t = torch::randn({4, 3});
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      torch::Tensor out;
      torch::Tensor ref_out;
      {
        CpuAutocast autocast;
        out = pipe->forward(x);
        ref_out = torch::cat({ref->forward(x.chunk(2)[0]), ref->forward(x.chunk(2)[1])});
      }
      CHECK(out.dtype() == ref_out.dtype());
      CHECK(out.equal(ref_out));
      mse(out, t).backward();
      mse(ref_out, t).backward();
      check_same(*pipe, *ref, "forward " + std::to_string(step));
      opt.step();
      ref_opt.step();
    }
  }
}
