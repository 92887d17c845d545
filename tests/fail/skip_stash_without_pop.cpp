// Stage 0 stashes skip "x" of namespace Encoder1, but no later layer pops it: the pipe must not
// compile, and the diagnostic must name stage 0, layer 0, the namespace and the name.
// expect-error: stagewise::Pipe: a skip is stashed but no later layer pops it
// expect-error: stash_without_pop<false, stagewise::detail::stage_layer<0, 0>,
// expect-error: stagewise::skip<Encoder1, stagewise::fixed_string<2>{"x"}> >
#include "stagewise/pipe.hpp"

#include <torch/nn/modules/linear.h>

struct Encoder1 {};
using skip_x = stagewise::skip<Encoder1, "x">;

struct DownImpl : stagewise::Skippable<DownImpl, stagewise::stashes<skip_x>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<skip_x>(x);
    return x;
  }
};
TORCH_MODULE(Down);

int main() {
  auto pipe = stagewise::Pipe(stagewise::stages(Down(), torch::nn::Linear(2, 2)));
  (void)pipe;
}
