// quickstart: micro-batches and a fork/join ordering edge on real tensors.
//   ./bazelw run //examples:quickstart
#include <stagewise/stagewise.hpp>

#include <iostream>
#include <mutex>
#include <string>
#include <vector>

namespace sw = stagewise;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Doubles its input; its backward records which micro-batch it belongs to.
struct Traced : torch::autograd::Function<Traced> {
  static std::vector<std::string>& log() {
    static std::vector<std::string> entries;
    return entries;
  }
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t micro) {
    ctx->saved_data["micro"] = micro;
    return x * 2;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    log().push_back("backward of micro-batch " + std::to_string(ctx->saved_data["micro"].toInt()));
    return {g[0] * 2, torch::Tensor()};
  }
};

int main() {
  auto x = torch::arange(12, torch::kFloat).view({6, 2}).requires_grad_();
  auto micro = sw::scatter(sw::Batch(x), 3);
  std::cout << "scattered a batch of " << x.size(0) << " rows into " << micro.size()
            << " micro-batches\n";

  // Chain the micro-batches like a pipeline stage does: fork each one's input and join the
  // phony into the next, so backward must finish micro-batch i+1 before it starts micro-batch i.
  std::vector<sw::Batch> outputs;
  torch::Tensor previous_phony;
  for (std::size_t i = 0; i < micro.size(); ++i) {
    auto input = micro[i].tensor();
    if (previous_phony.defined()) input = sw::join(input, previous_phony);
    auto [kept, phony] = sw::fork(input);
    previous_phony = phony;
    outputs.emplace_back(Traced::apply(kept, static_cast<int64_t>(i)));
  }
  auto y = sw::gather(outputs).tensor();
  y.sum().backward();

  for (const auto& line : Traced::log()) std::cout << "  " << line << "\n";
  const bool ordered = Traced::log() == std::vector<std::string>{
      "backward of micro-batch 2", "backward of micro-batch 1", "backward of micro-batch 0"};
  const bool exact = x.grad().equal(torch::full({6, 2}, 2.0f));
  std::cout << "backward ran in reverse micro-batch order: " << (ordered ? "yes" : "NO") << "\n"
            << "gradient equals the unsplit computation's: " << (exact ? "yes" : "NO") << "\n";
  return ordered && exact ? 0 : 1;
}
