// The flags of examples/gpt.cpp: `--name=value` (or `--name` for a switch), each checked, and
// every mistake an error naming the flag and what it takes.
#pragma once

#include "examples/gpt/model.hpp"

#include <stagewise/stagewise.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace gpt {

/// Where a run writes by default: gpt_out, or the test's own directory under `bazel test`.
inline std::string default_out() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return tmp ? std::string(tmp) + "/gpt_out" : "gpt_out";
}

struct Flags {
  Config model;
  int64_t steps = 150, batch = 16, chunks = 4, stages = 2, eval_every = 25, save_every = 100;
  double lr = 3e-3, clip = 1.0;
  double expect_valid = 0;  // > 0: exit 1 unless the final validation loss is below it
  std::string schedule = "1f1b", checkpoint = "except_last", device = "auto";
  std::string out = default_out(), data = "/usr/share/games/fortunes";
  bool bf16 = false, fp16 = false, resume = false;
  uint64_t seed = 0;
};

/// bf16 autocast on or off for the stages' devices (`--bf16`): CUDA's when --device asks for a
/// GPU, else the CPU's. The stage workers inherit it.
inline void set_bf16_autocast(const std::string& device, bool on) {
  const bool cuda = device != "cpu" && torch::cuda::is_available();
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
  const auto type = cuda ? at::kCUDA : at::kCPU;
  at::autocast::set_autocast_enabled(type, on);
  at::autocast::set_autocast_dtype(type, at::kBFloat16);
#else
  if (cuda) {
    at::autocast::set_enabled(on);
    at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
  } else {
    at::autocast::set_cpu_enabled(on);
    at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
  }
#endif
}

/// fp16 autocast on or off for CUDA (`--fp16`, with an amp::GradScaler).
inline void set_fp16_autocast(bool on) {
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_enabled(at::kCUDA, on);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kHalf);
#else
  at::autocast::set_enabled(on);
  at::autocast::set_autocast_gpu_dtype(at::kHalf);
#endif
}

/// Refuses --fp16 where a stage is not on a CUDA GPU: fp16 training (autocast with a GradScaler)
/// is for GPUs here; on the CPU --bf16 needs no scaler.
inline void check_fp16(const Flags& f, const std::vector<torch::Device>& devices) {
  if (!f.fp16) return;
  TORCH_CHECK(!f.bf16, "gpt: --fp16 and --bf16 together; pick one");
  bool gpu = !devices.empty();
  for (const auto& d : devices) gpu = gpu && d.is_cuda();
  TORCH_CHECK(gpu, "gpt: --fp16 trains in fp16 on CUDA GPUs (autocast with a GradScaler), but "
              "this run's stages are not all on a GPU (--device=", f.device,
              torch::cuda::is_available() ? "" : "; no CUDA GPU here",
              "); use --bf16 on the CPU, or --device=cuda");
}

inline const char* usage =
    "usage: gpt [--steps=150] [--batch=16] [--chunks=4] [--stages=2] [--layers=4] [--dim=64]\n"
    "           [--heads=4] [--context=64] [--lr=3e-3] [--clip=1.0 (0: off)]\n"
    "           [--schedule=1f1b|zb] [--checkpoint=always|except_last|never] [--bf16|--fp16]\n"
    "           [--device=auto|cpu|cuda|cuda:N|cpu,cuda:0] [--out=gpt_out] [--resume]\n"
    "           [--eval-every=25] [--save-every=100] [--seed=0] [--data=/usr/share/games/fortunes]\n"
    "           [--expect-valid=X (exit 1 unless the final validation loss is below X)]\n"
    "           [--small (2 layers, dim 32, 2 heads, context 32, batch 16, chunks 2, lr 1e-2)]\n"
    "Under tools/launch -n K (WORLD_SIZE set) each rank runs one of K stages.";

inline int64_t to_int(const std::string& name, const std::string& v, int64_t min) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  TORCH_CHECK(!v.empty() && *end == '\0' && n >= min, "gpt: --", name,
              " takes a whole number >= ", min, ", got '", v, "'\n", usage);
  return n;
}

inline double to_double(const std::string& name, const std::string& v, double min) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  TORCH_CHECK(!v.empty() && *end == '\0' && x >= min, "gpt: --", name, " takes a number >= ",
              min, ", got '", v, "'\n", usage);
  return x;
}

inline Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {  // the preset first: the other flags change it
    if (std::string(argv[i]) == "--small") {
      f.model.layers = 2, f.model.dim = 32, f.model.heads = 2, f.model.context = 32;
      f.batch = 16, f.chunks = 2, f.lr = 1e-2, f.eval_every = 10;
    }
  }
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    TORCH_CHECK(arg.rfind("--", 0) == 0, "gpt: unexpected argument '", arg, "'\n", usage);
    const auto eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const bool has_value = eq != std::string::npos;
    const std::string v = has_value ? arg.substr(eq + 1) : "";
    auto need = [&] { TORCH_CHECK(has_value, "gpt: --", name, " needs a value (--", name, "=...)\n", usage); };
    if (name == "small") {
      TORCH_CHECK(!has_value, "gpt: --small is a switch; write it without a value");
      continue;
    }
    if (name == "bf16" || name == "fp16" || name == "resume") {
      TORCH_CHECK(!has_value, "gpt: --", name, " is a switch; write it without a value");
      (name == "bf16" ? f.bf16 : name == "fp16" ? f.fp16 : f.resume) = true;
      continue;
    }
    static const char* const known[] = {
        "steps", "batch", "chunks", "stages", "layers", "dim", "heads", "context", "eval-every",
        "save-every", "seed", "lr", "clip", "expect-valid", "schedule", "checkpoint", "device",
        "out", "data"};
    TORCH_CHECK(std::find(std::begin(known), std::end(known), name) != std::end(known),
                "gpt: unknown flag --", name, "\n", usage);
    need();
    if (name == "steps") f.steps = to_int(name, v, 1);
    else if (name == "batch") f.batch = to_int(name, v, 1);
    else if (name == "chunks") f.chunks = to_int(name, v, 1);
    else if (name == "stages") f.stages = to_int(name, v, 1);
    else if (name == "layers") f.model.layers = to_int(name, v, 1);
    else if (name == "dim") f.model.dim = to_int(name, v, 2);
    else if (name == "heads") f.model.heads = to_int(name, v, 1);
    else if (name == "context") f.model.context = to_int(name, v, 2);
    else if (name == "eval-every") f.eval_every = to_int(name, v, 1);
    else if (name == "save-every") f.save_every = to_int(name, v, 1);
    else if (name == "seed") f.seed = static_cast<uint64_t>(to_int(name, v, 0));
    else if (name == "lr") f.lr = to_double(name, v, 0);
    else if (name == "clip") f.clip = to_double(name, v, 0);
    else if (name == "expect-valid") f.expect_valid = to_double(name, v, 0);
    else if (name == "schedule") {
      TORCH_CHECK(v == "1f1b" || v == "zb", "gpt: --schedule takes 1f1b or zb (zero-bubble ZB-H1), got '", v, "'");
      f.schedule = v;
    } else if (name == "checkpoint") {
      TORCH_CHECK(v == "always" || v == "except_last" || v == "never",
                  "gpt: --checkpoint takes always, except_last or never, got '", v, "'");
      f.checkpoint = v;
    } else if (name == "device") f.device = v;
    else if (name == "out") f.out = v;
    else f.data = v;  // "data", the last known name
  }
  check(f.model);
  TORCH_CHECK(f.stages <= f.model.layers + 2, "gpt: --stages=", f.stages, " is more than the ",
              f.model.layers + 2, " layers (embed, ", f.model.layers, " blocks, head)");
  return f;
}

}  // namespace gpt
