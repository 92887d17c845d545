#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <string_view>

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
