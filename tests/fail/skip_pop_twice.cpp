// Two layers pop skip "x" of namespace Encoder1: the diagnostic must name the second pop (stage 2,
// layer 0) and say that each stash is popped once.
// expect-error: stagewise::Pipe: a skip is popped twice in one namespace
// expect-error: popped_twice<false, stagewise::detail::stage_layer<2, 0>,
// expect-error: stagewise::skip<Encoder1, stagewise::fixed_string<2>{"x"}> >
// expect-error: Each stash is popped exactly once
#include "stagewise/pipe.hpp"

struct Encoder1 {};
using skip_x = stagewise::skip<Encoder1, "x">;

struct DownImpl : stagewise::Skippable<DownImpl, stagewise::stashes<skip_x>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<skip_x>(x);
    return x;
  }
};
TORCH_MODULE(Down);
struct UpImpl : stagewise::Skippable<UpImpl, stagewise::pops<skip_x>> {
  torch::Tensor forward(torch::Tensor x) { return x + pop<skip_x>(); }
};
TORCH_MODULE(Up);

int main() {
  auto pipe = stagewise::Pipe(stagewise::stages(Down(), Up(), Up()));
  (void)pipe;
}
