#pragma once

#include "stagewise/core/batch.hpp"

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>

namespace stagewise::detail {

// A stage with its type erased: what the executors run.
struct StageSpec {
  std::string name;                             // for messages: "stage 1" / "stage 1 (layers 2..3)"
  std::function<Batch(const Batch&)> fn;        // the stage's forward over batches
  std::shared_ptr<torch::nn::Module> module;    // registered for parameters(); null for lambdas
};

}  // namespace stagewise::detail
