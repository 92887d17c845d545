// One layer declares that it stashes and pops skip "x" of namespace Encoder1: the diagnostic must
// name it (stage 1, layer 0) and say to keep the tensor in a local variable instead.
// expect-error: stagewise::Pipe: a layer stashes and pops the same skip
// expect-error: stash_and_pop_in_one_layer<false, stagewise::detail::stage_layer<1, 0>,
// expect-error: stagewise::skip<Encoder1, stagewise::fixed_string<2>{"x"}> >
#include "stagewise/pipe.hpp"

#include <torch/nn/modules/linear.h>

struct Encoder1 {};
using skip_x = stagewise::skip<Encoder1, "x">;

struct LoopImpl
    : stagewise::Skippable<LoopImpl, stagewise::stashes<skip_x>, stagewise::pops<skip_x>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<skip_x>(x);
    return pop<skip_x>();
  }
};
TORCH_MODULE(Loop);

int main() {
  auto pipe = stagewise::Pipe(stagewise::stages(torch::nn::Linear(2, 2), Loop()));
  (void)pipe;
}
