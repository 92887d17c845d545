// LBFGS's step needs the loss closure, so it cannot run inside a gradient hook: passing its options
// to FusedStep is a compile error that names the concept they fail.
// expect-error: fusable_options<Options>
// expect-error: optimizer_for
#include "stagewise/optim/fused_step.hpp"

#include <torch/optim/lbfgs.h>

#include <vector>

void fuse_lbfgs(std::vector<torch::Tensor> params) {
  stagewise::optim::FusedStep fused(params, torch::optim::LBFGSOptions(1.0));
}
