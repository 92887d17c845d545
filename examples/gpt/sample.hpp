// Text from the trained model of examples/gpt.cpp: the gathered weights loaded into a model on
// the CPU, which samples bytes after a document start (byte 0) until the next one.
#pragma once

#include "examples/gpt/export.hpp"
#include "examples/gpt/model.hpp"

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

/// Copies `weights` (parameters and buffers by name) into `model`; every name must match.
inline void load_weights(torch::nn::Module& model, const NamedTensors& weights) {
  torch::NoGradGuard no_grad;
  std::size_t used = 0;
  auto copy = [&](const std::string& name, torch::Tensor& t) {
    auto it = weights.find(name);
    TORCH_CHECK(it != weights.end(), "gpt: the weights have no '", name, "'");
    t.copy_(it->second);
    ++used;
  };
  for (auto& p : model.named_parameters(true)) copy(p.key(), p.value());
  for (auto& b : model.named_buffers(true)) copy(b.key(), b.value());
  TORCH_CHECK(used == weights.size(), "gpt: the weights hold ", weights.size(),
              " tensors, the model ", used);
}

/// Up to `bytes` bytes sampled (temperature 0.8) from `model`, as printable text.
inline std::string generate(torch::nn::Sequential& model, const Config& c, int bytes,
                            uint64_t seed) {
  model->eval();
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed + 99);
  std::vector<int64_t> ids{0};
  std::string text;
  for (int i = 0; i < bytes; ++i) {
    const auto start = static_cast<int64_t>(ids.size()) > c.context ? ids.size() - c.context : 0;
    auto x = torch::tensor(std::vector<int64_t>(ids.begin() + start, ids.end())).unsqueeze(0);
    auto logits = model->forward(x)[0][-1].to(torch::kFloat);
    const auto next = torch::multinomial(torch::softmax(logits / 0.8, -1), 1, false, gen).item<int64_t>();
    if (next == 0) break;
    ids.push_back(next);
    text += next == '\n' ? std::string(" / ") : std::string(1, next >= 32 && next < 127 ? char(next) : '?');
  }
  return text;
}

/// Writes `ids` and the model's logits for them as a pickled dict {"ids", "logits"}: what a
/// Python copy of the model must reproduce (tests/gpt/load_in_python.py does).
inline void write_probe(torch::nn::Sequential& model, const torch::Tensor& ids,
                        const std::string& path) {
  torch::NoGradGuard no_grad;
  model->eval();
  c10::Dict<std::string, at::Tensor> probe;
  probe.insert("ids", ids.contiguous());
  probe.insert("logits", model->forward(ids).to(torch::kFloat).contiguous());
  const auto bytes = torch_save_bytes(c10::IValue(probe));
  write_bytes(path, bytes.data(), bytes.size());
}

}  // namespace gpt
