#pragma once

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <sstream>
#include <string>

namespace stagewise::runtime {

/// What two ranks, or a save and the pipe loading it, must agree on about a stage: its parameters'
/// names, dtypes and shapes, e.g. "0.weight float [8, 4]; 0.bias float [8]".
///   auto s = stagewise::runtime::stage_signature(*stage_module);
inline std::string stage_signature(const torch::nn::Module& stage) {
  std::ostringstream out;
  bool first = true;
  for (const auto& p : stage.named_parameters(/*recurse=*/true)) {
    out << (first ? "" : "; ") << p.key() << " " << c10::toString(p.value().scalar_type()) << " "
        << p.value().sizes();
    first = false;
  }
  return out.str();
}

}  // namespace stagewise::runtime
