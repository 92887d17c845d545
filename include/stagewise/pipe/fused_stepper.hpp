#pragma once

namespace stagewise {

/// An optimizer step run from backward hooks that a pipeline can drive: it steps each parameter
/// on its k-th gradient of a step and checks the step's end (`optim::FusedStep` is one). Both
/// `Pipe` and `distributed::Pipe` take one in their fused `train_step`.
template <class F>
concept fused_stepper = requires(F& f, int k) {
  f.set_accumulation_steps(k);
  f.finish_step();
  f.reset_step();
};

}  // namespace stagewise
