// Stage 1 pops skip "x" of namespace Encoder1, but no earlier layer stashes it: the pipe must not
// compile, and the diagnostic must name stage 1, layer 0, the namespace and the name.
// expect-error: stagewise::Pipe: a layer pops a skip that no earlier layer stashes
// expect-error: pop_without_stash<false, stagewise::detail::stage_layer<1, 0>,
// expect-error: stagewise::skip<Encoder1, stagewise::fixed_string<2>{"x"}> >
#include "stagewise/pipe.hpp"

#include <torch/nn/modules/linear.h>

struct Encoder1 {};
using skip_x = stagewise::skip<Encoder1, "x">;

struct UpImpl : stagewise::Skippable<UpImpl, stagewise::pops<skip_x>> {
  torch::Tensor forward(torch::Tensor x) { return x + pop<skip_x>(); }
};
TORCH_MODULE(Up);

int main() {
  auto pipe = stagewise::Pipe(stagewise::stages(torch::nn::Linear(2, 2), Up()));
  (void)pipe;
}
