#pragma once

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include <string>
#include <string_view>
#include <vector>

namespace stagewise {

/// Which micro-batches keep only their input and recompute their activations in backward.
enum class Checkpoint {
  always,       ///< every micro-batch: least memory, one extra forward per cell
  except_last,  ///< all but the last micro-batch, whose backward starts at once (the default)
  never,        ///< none: fastest, every activation is kept
};

/// Parses "always", "except_last" or "never".
inline Checkpoint checkpoint_mode(std::string_view name) {
  if (name == "always") return Checkpoint::always;
  if (name == "except_last") return Checkpoint::except_last;
  if (name == "never") return Checkpoint::never;
  TORCH_CHECK(false, "stagewise: unknown checkpoint mode '", std::string(name),
              "'; use \"always\", \"except_last\" or \"never\"");
}

/// How many of a step's `m` micro-batches `mode` checkpoints: the first `checkpoint_stop` ones;
/// none in eval mode or under no-grad, where nothing is replayed.
inline int64_t checkpoint_stop(Checkpoint mode, int64_t m, bool training) {
  if (!training || !c10::GradMode::is_enabled()) return 0;
  switch (mode) {
    case Checkpoint::always:
      return m;
    case Checkpoint::except_last:
      return m - 1;
    case Checkpoint::never:
      return 0;
  }
  return 0;
}

/// `checkpoint_stop` for each stage's mode, in stage order.
inline std::vector<int64_t> checkpoint_stops(const std::vector<Checkpoint>& modes, int64_t m,
                                             bool training) {
  std::vector<int64_t> out;
  out.reserve(modes.size());
  for (auto mode : modes) out.push_back(checkpoint_stop(mode, m, training));
  return out;
}

inline const char* to_string(Checkpoint mode) {
  switch (mode) {
    case Checkpoint::always:
      return "always";
    case Checkpoint::except_last:
      return "except_last";
    case Checkpoint::never:
      return "never";
  }
  TORCH_CHECK(false, "stagewise: unknown checkpoint mode ", static_cast<int>(mode),
              "; use Checkpoint::always, Checkpoint::except_last or Checkpoint::never");
}

}  // namespace stagewise
