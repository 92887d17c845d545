// moe: a mixture-of-experts block (top-k routing, load-balancing loss, optional capacity) trained
// two ways: the standard way (a loop over the experts, Adam) and the stagewise way (experts in
// parallel with ParallelBranches, inside a pipeline stage, Adam fused into backward).
//   ./bazelw run -c opt //examples:moe -- --device=cuda   (default auto: the GPUs, else the CPU)
#include "benchmarks/common/memory.hpp"  // a CPU allocator that counts live tensor bytes

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace sw = stagewise;
using torch::autograd::AutogradContext;

// Adds `aux` to the training loss without changing `y`: backward gives `aux` the gradient 1.
struct AddAuxLoss : torch::autograd::Function<AddAuxLoss> {
  static torch::Tensor forward(AutogradContext*, torch::Tensor y, torch::Tensor /*aux*/) {
    return y;
  }
  static torch::autograd::variable_list backward(AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {g[0], torch::ones({}, g[0].options())};
  }
};

// The feed-forward half of a transformer block, x + MoE(LayerNorm(x)): each token goes to its
// top-k experts (weights renormalized over the k); an expert keeps at most `capacity` tokens
// (0: no limit); the Switch Transformer loss E * sum_e(tokens share_e * mean router prob_e)
// keeps the experts balanced.
struct MoEBlockImpl : torch::nn::Module {
  MoEBlockImpl(int64_t dim, int64_t hidden, int64_t count, int64_t top_k, int64_t capacity)
      : k(top_k), capacity(capacity) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    router = register_module("router", torch::nn::Linear(dim, count));
    experts = register_module("experts", sw::ParallelBranches());
    for (int64_t e = 0; e < count; ++e) {
      experts->push_back(torch::nn::Sequential(torch::nn::Linear(dim, hidden), torch::nn::GELU(),
                                               torch::nn::Linear(hidden, dim)));
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto h = norm->forward(x);
    auto probs = torch::softmax(router->forward(h), -1);
    auto [gate, choice] = probs.topk(k, -1);
    gate = gate / gate.sum(-1, true);
    const int64_t count = experts->size();
    std::vector<torch::Tensor> token, weight, inputs;
    for (int64_t e = 0; e < count; ++e) {
      auto hit = (choice == e).nonzero();  // (token, slot) pairs, by token
      if (capacity > 0) hit = hit.narrow(0, 0, std::min(capacity, hit.size(0)));
      token.push_back(hit.select(1, 0));
      weight.push_back(gate.flatten().index_select(0, token.back() * k + hit.select(1, 1)));
      inputs.push_back(h.index_select(0, token.back()));
    }
    tokens_per_expert = torch::bincount(choice.flatten(), {}, count);
    auto share = tokens_per_expert.to(torch::kFloat) / choice.numel();
    aux_loss = count * (share * probs.mean(0)).sum();

    std::vector<torch::Tensor> outs;
    if (parallel) {
      outs = experts->forward_each(inputs);  // on the pool; an expert without tokens is free
    } else {
      for (int64_t e = 0; e < count; ++e) {  // the standard way: one after another
        auto expert = experts->children()[e]->as<torch::nn::Sequential>();
        outs.push_back(inputs[e].size(0) ? expert->forward(inputs[e]) : inputs[e]);
      }
    }
    auto y = torch::zeros_like(h);
    for (int64_t e = 0; e < count; ++e) y.index_add_(0, token[e], outs[e] * weight[e].unsqueeze(1));
    return AddAuxLoss::apply(x + y, 0.01 * aux_loss);
  }

  int64_t k, capacity;
  bool parallel = true;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear router{nullptr};
  sw::ParallelBranches experts{nullptr};
  torch::Tensor tokens_per_expert, aux_loss;
};
TORCH_MODULE(MoEBlock);

struct Result {
  std::vector<double> losses;
  double peak_mib = 0, step_ms = 0;
};

Result train(bool stagewise, const torch::Tensor& x, const torch::Tensor& y,
             const std::vector<torch::Device>& devices) {
  auto& memory = sw::bench::counting_allocator();
  torch::manual_seed(0);
  MoEBlock block(64, 256, 4, /*top_k=*/2, /*capacity=*/160);
  torch::nn::Linear head(64, 8);
  block->parallel = stagewise;
  auto pipe = sw::Pipe(sw::stages(block, head), sw::PipeOptions().chunks(2).devices(devices));
  const auto adam = torch::optim::AdamOptions(3e-3);
  torch::optim::Adam standard(pipe->parameters(), adam);
  sw::optim::FusedStep fused(pipe->named_parameters(), adam);  // hooks on; unused if standard
  if (!stagewise) fused.detach();
  auto mse = [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); };
  Result r;
  std::vector<double> ms;
  for (int step = 0; step < 12; ++step) {
    memory.reset_peak();
    const auto t0 = std::chrono::steady_clock::now();
    torch::Tensor loss;
    if (stagewise) {
      loss = pipe->train_step(x, y, mse, fused);  // parameters updated inside backward
    } else {  // the same two modules, each on its stage's device
      loss = mse(head(block(x.to(devices[0])).to(devices[1])), y.to(devices[1]));
      loss.backward();
      standard.step();
      for (auto& p : pipe->parameters()) p.mutable_grad().reset();  // zero_grad(set_to_none)
    }
    for (auto d : devices)  // a GPU works after the calls return: wait for it
      if (d.is_cuda()) torch::cuda::synchronize(d.index());
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    r.peak_mib = std::max(r.peak_mib, memory.peak() / 1048576.0);
    r.losses.push_back(loss.item<double>());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  r.step_ms = ms[ms.size() / 2];
  std::printf("%-9s tokens per expert (last micro-batch):", stagewise ? "stagewise" : "standard");
  for (int64_t e = 0; e < 4; ++e) std::printf(" %ld", block->tokens_per_expert[e].item<int64_t>());
  std::printf("  aux loss %.4f\n", block->aux_loss.item<double>());
  return r;
}

int main(int argc, char** argv) {
  const std::string flag = argc > 1 ? argv[1] : "--device=auto";
  if (argc > 2 || !flag.starts_with("--device=")) {
    std::fprintf(stderr, "usage: %s [--device=auto|cpu|cuda|cuda:N|cpu,cuda:0]\n", argv[0]);
    return 2;
  }
  // auto: the block and the head on a GPU each when there are two, else both on cuda:0, else
  // both on the CPU. The data stays on the CPU: the pipe moves it.
  const auto devices = sw::place_stages(2, flag.substr(9));
  for (std::size_t k = 0; k < 2; ++k) std::printf("stage %zu on %s\n", k, devices[k].str().c_str());
  at::set_num_threads(1);  // the experts' parallelism comes from ParallelBranches
  sw::bench::counting_allocator();
  torch::manual_seed(1);
  auto x = torch::randn({256, 64});
  auto y = torch::tanh(x.matmul(torch::randn({64, 8})));
  const Result standard = train(false, x, y, devices), stagewise = train(true, x, y, devices);
  for (std::size_t s = 0; s < standard.losses.size(); s += 3) {
    std::printf("step %2zu loss: standard %.5f stagewise %.5f\n", s, standard.losses[s],
                stagewise.losses[s]);
  }
  std::printf("peak CPU tensor memory: standard %.0f KiB, stagewise %.0f KiB\n",
              standard.peak_mib * 1024, stagewise.peak_mib * 1024);
  std::printf("step time (median): standard %.1f ms, stagewise %.1f ms\n", standard.step_ms,
              stagewise.step_ms);
  const bool learned = standard.losses.back() < standard.losses.front() * 0.8 &&
                       stagewise.losses.back() < stagewise.losses.front() * 0.8;
  std::printf("loss went down: %s\n", learned ? "yes" : "NO");
  return learned ? 0 : 1;
}
