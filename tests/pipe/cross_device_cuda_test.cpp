// Pipelines whose stages cross between devices: CPU+GPU mixes (one GPU is enough: they take the
// same copies, streams and events as two GPUs) and two GPUs. Every case compares the pipe with
// the same layers run unpipelined on the same devices, micro-batch by micro-batch, with a GPU
// stage heavy enough that a copy read before it lands gives wrong numbers. Skipped without a GPU.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/skip/skippable.hpp"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace sw = stagewise;

namespace {

const bool no_cuda = !torch::cuda::is_available();
const bool fewer_than_two = torch::cuda::device_count() < 2;
const torch::Device cpu(torch::kCPU);

torch::Device gpu(int i = 0) {
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

// |got - want| / |want|, over every element.
double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  const auto g = got.detach().to(cpu, torch::kDouble);
  const auto w = want.detach().to(cpu, torch::kDouble);
  return (g - w).norm().item<double>() / std::max(w.norm().item<double>(), 1e-30);
}

// `stages` stages of `per_stage` x (Linear(width) + Tanh); the GPU stages' products are large
// enough to still run when the next stage would read a copy too early.
torch::nn::Sequential model(int stages, int per_stage, int width) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int k = 0; k < stages * per_stage; ++k) {
    seq->push_back(torch::nn::Linear(width, width));
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

// The unpipelined reference: each layer on the device the pipe gives its stage, tensors moved
// between them with blocking copies, micro-batch by micro-batch (backward from the last one, as
// the pipes do), the loss of each weighted by its share of the rows.
struct Reference {
  torch::nn::Sequential seq;
  std::vector<torch::Device> layer_devices;

  Reference(const torch::nn::Sequential& original, const std::vector<torch::Device>& devices,
            int layers_per_stage)
      : seq(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(original->clone())) {
    for (std::size_t l = 0; l < seq->size(); ++l) {
      const auto d = devices[l / static_cast<std::size_t>(layers_per_stage)];
      seq[l]->to(d);
      layer_devices.push_back(d);
    }
  }

  torch::Tensor forward(torch::Tensor x) {
    std::size_t l = 0;
    for (auto& layer : *seq) {
      x = x.to(layer_devices[l++]);
      x = layer.forward(x);
    }
    return x;
  }

  void train(const torch::Tensor& x, const torch::Tensor& t, int chunks) {
    auto xs = x.chunk(chunks);
    auto ts = t.chunk(chunks);
    std::vector<torch::Tensor> losses;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      auto out = forward(xs[i]);
      losses.push_back(mse(out, ts[i].to(out.device())) *
                       (static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0))));
    }
    for (auto it = losses.rbegin(); it != losses.rend(); ++it) it->backward();
  }
};

void check_gradients(sw::Pipe<>& pipe, Reference& ref, const std::string& what) {
  auto got = pipe->parameters();
  auto want = ref.seq->parameters();
  REQUIRE(got.size() == want.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO(what << ", parameter " << k);
    REQUIRE(got[k].grad().defined());
    CHECK(got[k].grad().device() == got[k].device());
    CHECK(got[k].device() == want[k].device());
    CHECK(relative_error(got[k].grad(), want[k].grad()) < 1e-5);
  }
}

std::string name_of(const std::vector<torch::Device>& devices) {
  std::string s = "{";
  for (const auto& d : devices) s += d.str() + (&d == &devices.back() ? "}" : ", ");
  return s;
}

// One train_step of `sched` over `devices` (one stage each) against the reference; the input and
// target are given on the CPU and the pipe moves them.
template <class Schedule>
void check_train_step(const std::vector<torch::Device>& devices, const Schedule& sched,
                      const std::string& checkpoint, const std::string& sched_name) {
  const int stages = static_cast<int>(devices.size());
  const int per_stage = 3, width = 512, rows = 1024, chunks = 4;
  auto seq = model(stages, per_stage, width);
  Reference ref(seq, devices, 2 * per_stage);
  std::vector<int64_t> balance(static_cast<std::size_t>(stages), 2 * per_stage);
  auto pipe = sw::Pipe(seq, sw::balance(balance.begin(), balance.end()),
                       sw::PipeOptions().chunks(chunks).checkpoint(checkpoint).devices(devices));
  torch::manual_seed(1);
  const auto x = torch::randn({rows, width});
  const auto t = torch::randn({rows, width});
  for (int step = 0; step < 2; ++step) {  // the second step reuses freed memory
    pipe->zero_grad();
    ref.seq->zero_grad();
    auto loss = pipe->train_step(x, t, mse, sched);
    ref.train(x, t, chunks);
    const std::string what = name_of(devices) + " " + sched_name + " checkpoint " + checkpoint +
                             " step " + std::to_string(step);
    INFO(what);
    CHECK(loss.device() == devices.back());  // the loss lands on the last stage's device
    check_gradients(pipe, ref, what);
  }
}

const std::vector<std::vector<torch::Device>>& mixes() {
  static const std::vector<std::vector<torch::Device>> all = {
      {cpu, gpu()}, {gpu(), cpu}, {cpu, gpu(), cpu, gpu()}, {gpu(), cpu, gpu(), cpu}};
  return all;
}

// ---- skips across devices: stage 0 stashes its input, the last stage adds it ----
struct Across {};
using skip_x = sw::skip<Across, "x">;
struct StashImpl : sw::Skippable<StashImpl, sw::stashes<skip_x>> {
  torch::Tensor forward(torch::Tensor x) {
    sw::stash<skip_x>(this, x);
    return x;
  }
};
TORCH_MODULE(Stash);
struct PopImpl : sw::Skippable<PopImpl, sw::pops<skip_x>> {
  torch::Tensor forward(torch::Tensor x) { return x + sw::pop<skip_x>(this); }
};
TORCH_MODULE(Pop);

}  // namespace

TEST_SUITE("gradients across devices") {
  TEST_CASE("cpu_cuda: train_step over CPU+GPU mixes equals the unpipelined model" *
            doctest::skip(no_cuda)) {
    for (const auto& devices : mixes()) {
      for (const std::string mode : {"never", "except_last", "always"}) {
        check_train_step(devices, sw::schedule::gpipe{}, mode, "gpipe");
        check_train_step(devices, sw::schedule::one_f_one_b{}, mode, "1f1b");
      }
      check_train_step(devices, sw::schedule::zero_bubble_h1{}, "never", "zb-h1");
      check_train_step(devices, sw::schedule::zero_bubble_h1{}, "except_last", "zb-h1");
      if (devices.size() == 4) {
        check_train_step(devices, sw::schedule::interleaved_one_f_one_b{2}, "except_last",
                         "interleaved");
      }
    }
  }

  TEST_CASE("cpu_cuda: forward over CPU+GPU mixes, and backward through it, equal the model" *
            doctest::skip(no_cuda)) {
    const int per_stage = 3, width = 1024, rows = 2048;
    for (const auto& devices : mixes()) {
      for (const std::string mode : {"never", "except_last", "always"}) {
        const int stages = static_cast<int>(devices.size());
        auto seq = model(stages, per_stage, width);
        Reference ref(seq, devices, 2 * per_stage);
        std::vector<int64_t> balance(static_cast<std::size_t>(stages), 2 * per_stage);
        auto pipe = sw::Pipe(seq, sw::balance(balance.begin(), balance.end()),
                             sw::PipeOptions().chunks(4).checkpoint(mode).devices(devices));
        torch::manual_seed(2);
        const auto x = torch::randn({rows, width});
        const std::string what = name_of(devices) + " forward, checkpoint " + mode;
        INFO(what);
        auto y = pipe->forward(x);
        CHECK(y.device() == devices.back());
        auto want = ref.forward(x);
        CHECK(relative_error(y, want) < 1e-5);
        y.sum().backward();
        want.sum().backward();
        check_gradients(pipe, ref, what);
      }
    }
  }

  TEST_CASE("cpu_cuda: a skip across CPU and GPU stages carries its tensor and its gradient" *
            doctest::skip(no_cuda)) {
    for (const auto& devices :
         std::vector<std::vector<torch::Device>>{{cpu, gpu()}, {gpu(), cpu}, {cpu, gpu(), cpu}}) {
      for (const std::string mode : {"never", "always"}) {
        torch::manual_seed(3);
        const int width = 256;
        torch::nn::Sequential seq(Stash(), torch::nn::Linear(width, width), torch::nn::Tanh(),
                                  torch::nn::Linear(width, width), Pop());
        std::vector<int64_t> balance =
            devices.size() == 2 ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{2, 2, 1};
        auto l1 = seq[1]->as<torch::nn::Linear>()->weight.detach().clone();
        auto b1 = seq[1]->as<torch::nn::Linear>()->bias.detach().clone();
        auto l3 = seq[3]->as<torch::nn::Linear>()->weight.detach().clone();
        auto b3 = seq[3]->as<torch::nn::Linear>()->bias.detach().clone();
        auto pipe = sw::Pipe(seq, sw::balance(balance.begin(), balance.end()),
                             sw::PipeOptions().chunks(4).checkpoint(mode).devices(devices));
        const auto x = torch::randn({512, width});
        const auto t = torch::randn({512, width});
        // The reference on the CPU in double: (tanh(x W1^T + b1)) W3^T + b3 + x.
        auto w1 = l1.to(torch::kDouble).requires_grad_();
        auto w3 = l3.to(torch::kDouble).requires_grad_();
        auto xd = x.to(torch::kDouble);
        auto out = torch::linear(torch::tanh(torch::linear(xd, w1, b1.to(torch::kDouble))), w3,
                                 b3.to(torch::kDouble)) +
                   xd;
        torch::mse_loss(out, t.to(torch::kDouble)).backward();
        INFO(name_of(devices) << " checkpoint " << mode);
        for (const bool train_step : {false, true}) {
          pipe->zero_grad();
          if (train_step) {
            pipe->train_step(x, t, mse, sw::schedule::one_f_one_b{});
          } else {
            auto y = pipe->forward(x);
            CHECK(relative_error(y, out) < 1e-5);
            mse(y, t.to(y.device())).backward();
          }
          CHECK(relative_error(seq[1]->as<torch::nn::Linear>()->weight.grad(), w1.grad()) < 1e-5);
          CHECK(relative_error(seq[3]->as<torch::nn::Linear>()->weight.grad(), w3.grad()) < 1e-5);
        }
      }
    }
  }

  TEST_CASE("cpu_cuda: the input and target go to their stages from wherever they are" *
            doctest::skip(no_cuda)) {
    auto seq = model(2, 1, 64);
    auto pipe = sw::Pipe(seq, sw::balance{2, 2}, sw::PipeOptions().chunks(2).devices({gpu(), cpu}));
    const auto x = torch::randn({8, 64});
    const auto t = torch::randn({8, 64});
    for (const auto& [xd, td] : std::vector<std::pair<torch::Device, torch::Device>>{
             {cpu, cpu}, {gpu(), gpu()}, {cpu, gpu()}}) {
      pipe->zero_grad();
      auto loss = pipe->train_step(x.to(xd), t.to(td), mse);
      CHECK(loss.device() == cpu);
      CHECK(std::isfinite(loss.item<double>()));
    }
  }

  TEST_CASE("cuda: a model already on the GPU follows the devices it is given" *
            doctest::skip(no_cuda)) {
    auto seq = model(2, 1, 16);
    seq->to(gpu());
    auto pipe = sw::Pipe(seq, sw::balance{2, 2}, sw::PipeOptions().devices({cpu, gpu()}));
    for (const auto& p : seq[0]->parameters()) CHECK(p.device() == cpu);
    for (const auto& p : seq[2]->parameters()) CHECK(p.device() == gpu());
    // Without devices, each stage stays where its module is.
    auto seq2 = model(2, 1, 16);
    seq2->to(gpu());
    auto pipe2 = sw::Pipe(seq2, sw::balance{2, 2});
    CHECK(pipe2->device(0) == gpu());
    CHECK(pipe2->device(1) == gpu());
    auto y = pipe2->forward(torch::randn({4, 16}));
    CHECK(y.device() == gpu());
  }

  TEST_CASE("two_cuda: train_step over two GPUs equals the unpipelined model" *
            doctest::skip(fewer_than_two)) {
    for (const std::string mode : {"never", "except_last", "always"}) {
      check_train_step({gpu(0), gpu(1)}, sw::schedule::gpipe{}, mode, "gpipe");
      check_train_step({gpu(0), gpu(1)}, sw::schedule::one_f_one_b{}, mode, "1f1b");
    }
    check_train_step({gpu(0), gpu(1)}, sw::schedule::zero_bubble_h1{}, "never", "zb-h1");
    check_train_step({gpu(0), cpu, gpu(1)}, sw::schedule::one_f_one_b{}, "always", "1f1b");
  }
}
