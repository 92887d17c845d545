// Stage 1 takes one Tensor, but stage 0 returns a pair: the pipe must not compile, and the
// diagnostic must name the stage index (1) and say what to do.
// expect-error: stagewise::Pipe: a stage cannot take the output of the stage before it
// expect-error: check_stage_link<1
#include "stagewise/pipe.hpp"

#include <torch/nn/modules/linear.h>

#include <tuple>

struct PairImpl : torch::nn::Module {
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) { return {x, x}; }
};
TORCH_MODULE(Pair);

int main() {
  auto pipe = stagewise::Pipe(stagewise::stages(Pair(), torch::nn::Linear(2, 2)));
  (void)pipe;
}
