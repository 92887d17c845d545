// An int is not a stage: stages() must say so, name the argument's index and what a stage is.
// expect-error: stagewise::stages: this argument is not a stage
// expect-error: check_is_stage<1
#include "stagewise/stage/stage_list.hpp"

#include <torch/nn/modules/linear.h>

int main() {
  auto list = stagewise::stages(torch::nn::Linear(2, 2), 42);
  (void)list;
}
