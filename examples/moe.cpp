// moe: a mixture-of-experts layer whose experts run forward and backward in parallel.
//   ./bazelw run -c opt //examples:moe
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace sw = stagewise;

// Top-1 routing: a router scores the experts per token; each token goes to its best expert, whose
// output is scaled by the router's probability (so the router learns too).
struct MoEImpl : torch::nn::Module {
  MoEImpl(int64_t dim, int64_t hidden, int64_t count) {
    router = register_module("router", torch::nn::Linear(dim, count));
    experts = register_module("experts", sw::ParallelBranches());
    for (int64_t e = 0; e < count; ++e) {
      list.emplace_back(torch::nn::Linear(dim, hidden), torch::nn::ReLU(),
                        torch::nn::Linear(hidden, dim));
      experts->push_back(list.back());
    }
  }

  torch::Tensor forward(const torch::Tensor& x, bool parallel) {
    auto [gate, choice] = torch::softmax(router->forward(x), -1).max(-1);
    std::vector<torch::Tensor> index, tokens, outs;
    for (int64_t e = 0; e < int64_t(list.size()); ++e) {
      index.push_back((choice == e).nonzero().squeeze(1));
      tokens.push_back(x.index_select(0, index.back()));  // experts get different token counts
    }
    if (parallel) {
      outs = experts->forward_each(tokens);  // the experts run on the pool's threads
    } else {
      for (std::size_t e = 0; e < list.size(); ++e) outs.push_back(list[e]->forward(tokens[e]));
    }
    auto y = torch::zeros_like(x);
    for (std::size_t e = 0; e < list.size(); ++e) {
      y = y.index_add(0, index[e], outs[e] * gate.index_select(0, index[e]).unsqueeze(1));
    }
    return y;
  }

  torch::nn::Linear router{nullptr};
  sw::ParallelBranches experts{nullptr};
  std::vector<torch::nn::Sequential> list;
};
TORCH_MODULE(MoE);

int main() {
  at::set_num_threads(1);  // one core per expert: the speed-up then comes from parallel branches
  torch::manual_seed(0);
  MoE moe(128, 512, 4);
  auto x = torch::randn({1024, 128});
  auto target = torch::sin(x.matmul(torch::randn({128, 128})) * 0.1);
  auto routed = torch::bincount(std::get<1>(moe->router->forward(x).max(-1)), {}, 4);
  std::printf("tokens per expert:");
  for (int64_t e = 0; e < 4; ++e) std::printf(" %ld", routed[e].item<int64_t>());
  std::printf("\n");
  auto step = [&](bool parallel) {
    moe->zero_grad();
    auto loss = torch::nn::functional::mse_loss(moe->forward(x, parallel), target);
    const auto t0 = std::chrono::steady_clock::now();
    loss.backward();
    const auto t1 = std::chrono::steady_clock::now();
    return std::pair{loss, std::chrono::duration<double, std::milli>(t1 - t0).count()};
  };

  // The parallel layer computes exactly what the sequential one does.
  auto seq_loss = step(false).first;
  std::vector<torch::Tensor> seq_grads;
  for (const auto& p : moe->parameters()) seq_grads.push_back(p.grad().clone());
  bool same = step(true).first.equal(seq_loss);
  for (std::size_t i = 0; i < seq_grads.size(); ++i) {
    same = same && moe->parameters()[i].grad().equal(seq_grads[i]);
  }
  std::printf("loss and gradients, parallel vs sequential: %s\n",
              same ? "bitwise equal" : "DIFFER");

  // Backward time, median of 7 each (alternating, so other load hits both alike).
  std::vector<double> seq_ms, par_ms;
  for (int i = 0; i < 7; ++i) {
    seq_ms.push_back(step(false).second);
    par_ms.push_back(step(true).second);
  }
  std::nth_element(seq_ms.begin(), seq_ms.begin() + 3, seq_ms.end());
  std::nth_element(par_ms.begin(), par_ms.begin() + 3, par_ms.end());
  const double sequential = seq_ms[3], parallel = par_ms[3];
  std::printf("backward: sequential %.1f ms, parallel %.1f ms on %zu threads: speed-up %.2fx\n",
              sequential, parallel, sw::default_thread_pool()->size(), sequential / parallel);

  // Train a few steps with the parallel experts.
  torch::optim::SGD sgd(moe->parameters(), torch::optim::SGDOptions(2.0));
  std::vector<double> losses;
  for (int i = 0; i < 6; ++i) {
    losses.push_back(step(true).first.item<double>());
    sgd.step();
    std::printf("step %d loss %.5f\n", i, losses.back());
  }
  const bool learned = losses.back() < losses.front();
  std::printf("loss went down: %s\n", learned ? "yes" : "NO");
  return same && learned ? 0 : 1;
}
