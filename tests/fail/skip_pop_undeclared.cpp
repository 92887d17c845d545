// A block reused under several namespaces pops a skip of another namespace than the one it
// declares: stagewise::pop<S>(this) must not compile, and the diagnostic must name the layer and
// the skip.
// expect-error: stagewise::pop: this layer pops a skip it does not declare
// expect-error: pop_not_declared<false, UpImpl<Encoder2>,
// expect-error: stagewise::skip<Encoder1, stagewise::fixed_string<2>{"x"}> >
#include "stagewise/skip/skippable.hpp"

struct Encoder1 {};
struct Encoder2 {};

template <class Ns>
struct UpImpl : stagewise::Skippable<UpImpl<Ns>, stagewise::pops<stagewise::skip<Ns, "x">>> {
  torch::Tensor forward(torch::Tensor x) {
    return x + stagewise::pop<stagewise::skip<Encoder1, "x">>(this);  // should be Ns
  }
};

int main() {
  UpImpl<Encoder2> up;
  (void)up.forward(torch::Tensor());
}
