#pragma once

// Test helper: writes a save of format 1 as stagewise wrote it before format 2 (the save code of
// pipe/detail/pipe_saves.hpp and saved_state.hpp at commit 607d49b, for a one-process pipe), so
// that tests load the saves users already have.

#include "stagewise/core/rng.hpp"
#include "stagewise/runtime/stage_signature.hpp"

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace stagewise::testing {

/// Writes `pipe`'s format-1 save into `dir`: stage<j>.pt per stage, then rank0.pt with the plan
/// (one process, every stage on the CPU), the generators and `optimizer`'s own archive.
template <class PipeHolder, class Optimizer>
void write_format1_save(PipeHolder& pipe, const Optimizer& optimizer, const std::string& dir,
                        std::int64_t step) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  std::vector<std::string> signatures;
  for (std::size_t j = 0; j < pipe->num_stages(); ++j) {
    const auto module = pipe->named_children()["stage" + std::to_string(j)];
    signatures.push_back(runtime::stage_signature(*module));
    torch::serialize::OutputArchive a, m;
    a.write("format", c10::IValue(std::int64_t{1}));
    a.write("stage", c10::IValue(static_cast<std::int64_t>(j)));
    a.write("signature", c10::IValue(signatures.back()));
    std::int64_t n = 0;
    auto add = [&](const std::string& name, const torch::Tensor& t) {
      m.write("name" + std::to_string(n), c10::IValue(name));
      m.write("tensor" + std::to_string(n++), t.detach(), /*is_buffer=*/true);
    };
    for (const auto& p : module->named_parameters()) add(p.key(), p.value());
    for (const auto& b : module->named_buffers()) add(b.key(), b.value());
    m.write("tensors", c10::IValue(n));
    a.write("module", m);
    a.save_to((fs::path(dir) / ("stage" + std::to_string(j) + ".pt")).string());
  }
  torch::serialize::OutputArchive a, plan, rng, o;
  a.write("format", c10::IValue(std::int64_t{1}));
  a.write("step", c10::IValue(step));
  plan.write("processes", c10::IValue(std::int64_t{1}));
  plan.write("placement", c10::IValue(std::vector<std::int64_t>(signatures.size(), 0)));
  for (std::size_t j = 0; j < signatures.size(); ++j) {
    plan.write("signature" + std::to_string(j), c10::IValue(signatures[j]));
    plan.write("device" + std::to_string(j), c10::IValue(std::string("cpu")));
  }
  a.write("plan", plan);
  RngState::capture_all().save(rng);
  a.write("rng", rng);
  a.write("has_optimizer", c10::IValue(true));
  optimizer.save(o);
  a.write("optimizer", o);
  a.save_to((fs::path(dir) / "rank0.pt").string());
}

}  // namespace stagewise::testing
