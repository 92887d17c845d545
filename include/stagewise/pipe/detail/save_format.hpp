#pragma once

// The files of a pipe's save (format 2): every parameter, buffer and optimizer state under the
// model's own names, whatever plan wrote them, and the index that says which file holds which
// names. docs/pipe.md, "Save and resume", describes the layout; format 1 (a save that loads only
// under the plan that made it) is read by format1_save.hpp.

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace stagewise::detail {

/// The format this stagewise writes (the "format" entry of every file); it reads this one and 1.
inline constexpr std::int64_t kSaveFormat = 2;

inline std::string save_file(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}
inline std::string index_name() {
  return "index.pt";
}
inline std::string stage_name(std::size_t stage) {
  return "stage" + std::to_string(stage) + ".pt";
}
inline std::string optimizer_name(std::size_t stage) {
  return "stage" + std::to_string(stage) + ".optimizer.pt";
}
inline std::string rank_name(int rank) {
  return "rank" + std::to_string(rank) + ".pt";
}

/// Writes `archive` to `path` whole or not at all: into a temporary file beside it (`writer`
/// tells apart processes writing the same file), then renamed over it, so a process killed
/// while saving leaves the previous file or none.
inline void write_whole(torch::serialize::OutputArchive& archive, const std::string& path,
                        const std::string& writer = "") {
  const std::string temporary = path + ".partial" + writer;
  archive.save_to(temporary);
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  TORCH_CHECK(!ec, "could not rename ", temporary, " to ", path, ": ", ec.message());
}

/// A parameter or buffer as a save names it: the model's name for it ("3.weight": the
/// Sequential's layer and the tensor's name in it) and what it is ("Float [8, 6]", "buffer
/// Float [8]"), which a model loading the save must have alike.
struct TensorEntry {
  std::string name;
  std::string what;
};

inline std::string describe_tensor(const torch::Tensor& t, bool buffer) {
  std::ostringstream out;
  out << (buffer ? "buffer " : "") << t.scalar_type() << " " << t.sizes();
  return out.str();
}

/// A stage's defined parameters, then its defined buffers, each under the model's name: its
/// name in `module` after `prefix` (a Sequential's stage module names its layers as the
/// Sequential does; a typed stage j is prefixed "j.").
inline std::vector<std::pair<TensorEntry, torch::Tensor>> named_tensors(
    const torch::nn::Module& module, const std::string& prefix) {
  std::vector<std::pair<TensorEntry, torch::Tensor>> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    if (p.value().defined()) {
      out.push_back({{prefix + p.key(), describe_tensor(p.value(), false)}, p.value()});
    }
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) {
      out.push_back({{prefix + b.key(), describe_tensor(b.value(), true)}, b.value()});
    }
  }
  return out;
}

/// The plan that made a save, as a load needs it: how many processes and replicas ran it, the
/// rank (within a replica) of every stage, and every stage's layers (a typed stage is one).
struct SavePlan {
  std::int64_t processes = 1;
  std::int64_t replicas = 1;
  std::vector<std::int64_t> placement;  // rank within a replica, per stage
  std::vector<std::int64_t> layers;     // per stage

  std::int64_t workers() const {
    std::int64_t w = 0;
    for (auto r : placement) w = std::max(w, r + 1);
    return w;
  }
  std::int64_t total_layers() const {
    std::int64_t n = 0;
    for (auto l : layers) n += l;
    return n;
  }
  /// The stage that holds layer `layer`.
  std::size_t stage_of_layer(std::int64_t layer) const {
    std::int64_t end = 0;
    for (std::size_t j = 0; j < layers.size(); ++j) {
      end += layers[j];
      if (layer < end) return j;
    }
    return layers.size() - 1;
  }
  /// "4 stages on 4 processes" or "2 stages on 2 processes x 2 replicas" (for messages).
  std::string describe() const {
    std::ostringstream out;
    out << layers.size() << (layers.size() == 1 ? " stage" : " stages") << " on " << processes
        << (processes == 1 ? " process" : " processes");
    if (replicas > 1) out << " (" << replicas << " replicas)";
    return out.str();
  }
};

}  // namespace stagewise::detail
