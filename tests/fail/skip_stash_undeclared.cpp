// A layer stashes skip "y", which its stashes<...> does not list: the member stash<...> must not
// compile, and the diagnostic must name the layer and the skip.
// expect-error: stagewise::stash: this layer stashes a skip it does not declare
// expect-error: stash_not_declared<false, DownImpl,
// expect-error: stagewise::skip<Encoder1, stagewise::fixed_string<2>{"y"}> >
#include "stagewise/skip/skippable.hpp"

struct Encoder1 {};
using skip_x = stagewise::skip<Encoder1, "x">;
using skip_y = stagewise::skip<Encoder1, "y">;

struct DownImpl : stagewise::Skippable<DownImpl, stagewise::stashes<skip_x>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<skip_x>(x);
    stash<skip_y>(x);
    return x;
  }
};

int main() {
  DownImpl down;
  (void)down.forward(torch::Tensor());
}
