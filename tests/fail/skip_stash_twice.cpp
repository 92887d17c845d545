// Two layers stash skip "x" of namespace Encoder1 (the same block reused without a namespace of
// its own): the diagnostic must name the second stash (stage 0, layer 1) and say to use another
// namespace.
// expect-error: stagewise::Pipe: a skip is stashed twice in one namespace
// expect-error: stashed_twice<false, stagewise::detail::stage_layer<0, 1>,
// expect-error: stagewise::skip<Encoder1, stagewise::fixed_string<2>{"x"}> >
// expect-error: Give each stash its own namespace
#include "stagewise/pipe.hpp"
#include "stagewise/stage/seq.hpp"

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
  auto pipe = stagewise::Pipe(stagewise::stages(stagewise::seq(Down(), Down()), Up()));
  (void)pipe;
}
