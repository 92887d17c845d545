#pragma once

// The files of a pipe's save (Pipe::save, distributed::Pipe::save): one per stage and one per
// process, each written whole or not at all, and the plan that made them, compared with the pipe
// that loads them. docs/pipe.md, "Save and resume", describes the layout.

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <filesystem>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace stagewise::detail {

/// The version of the save format (the "format" entry of every file).
inline constexpr std::int64_t kSaveFormat = 1;

inline std::string stage_file(const std::string& dir, int stage) {
  return (std::filesystem::path(dir) / ("stage" + std::to_string(stage) + ".pt")).string();
}
inline std::string rank_file(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("rank" + std::to_string(rank) + ".pt")).string();
}

/// Writes `archive` to `path` whole or not at all: into a temporary file beside it, then renamed
/// over it, so a process killed while saving leaves the previous file or none.
inline void write_whole(torch::serialize::OutputArchive& archive, const std::string& path) {
  const std::string temporary = path + ".partial";
  archive.save_to(temporary);
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  TORCH_CHECK(!ec, "could not rename ", temporary, " to ", path, ": ", ec.message());
}

/// A stage's defined parameters, then its defined buffers, by name: what a save holds of it.
inline std::vector<std::pair<std::string, torch::Tensor>> module_tensors(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    if (p.value().defined()) out.emplace_back(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  }
  return out;
}

/// Writes a stage's parameters and buffers (module_tensors) into `archive`.
inline void write_module_state(const torch::nn::Module& module,
                               torch::serialize::OutputArchive& archive) {
  const auto tensors = module_tensors(module);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    archive.write("name" + std::to_string(i), c10::IValue(tensors[i].first));
    archive.write("tensor" + std::to_string(i), tensors[i].second.detach(), /*is_buffer=*/true);
  }
  archive.write("tensors", c10::IValue(static_cast<std::int64_t>(tensors.size())));
}

/// A stage's saved tensors, read and checked against `module` (names, shapes, dtypes) without
/// changing it; `copy_into` then copies them into its parameters and buffers in place (the
/// tensors keep their storage, so optimizers and hooks holding them see the loaded values).
class SavedModuleState {
 public:
  SavedModuleState(const torch::nn::Module& module, torch::serialize::InputArchive& archive,
                   const std::string& file) {
    const auto mine = module_tensors(module);
    c10::IValue v;
    archive.read("tensors", v);
    TORCH_CHECK(v.toInt() == static_cast<std::int64_t>(mine.size()), file, " holds ", v.toInt(),
                " parameters and buffers, but the stage has ", mine.size(),
                "; build the pipe with the model and balance that made the save");
    for (std::size_t i = 0; i < mine.size(); ++i) {
      archive.read("name" + std::to_string(i), v);
      torch::Tensor t;
      archive.read("tensor" + std::to_string(i), t, /*is_buffer=*/true);
      const auto& [name, target] = mine[i];
      TORCH_CHECK(v.toStringRef() == name && t.sizes() == target.sizes() &&
                      t.scalar_type() == target.scalar_type(),
                  file, " holds '", v.toStringRef(), "' (", t.scalar_type(), " ", t.sizes(),
                  ") where the stage has '", name, "' (", target.scalar_type(), " ", target.sizes(),
                  "); build the pipe with the model and balance that made it");
      tensors_.emplace_back(target, std::move(t));
    }
  }

  void copy_into() const {
    torch::NoGradGuard no_grad;
    for (const auto& [target, saved] : tensors_) {
      torch::Tensor(target).copy_(saved);
    }
  }

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> tensors_;  // (the stage's, the saved)
};

/// What made a save, and what a pipe loading it must have alike: the number of processes, the
/// process of every stage, every stage's signature (parameter names, dtypes, shapes) and the
/// device of each of this process's stages ("" for another process's).
struct SavedPlan {
  std::int64_t processes = 1;
  std::vector<std::int64_t> placement;
  std::vector<std::string> signatures;
  std::vector<std::string> devices;

  void write(torch::serialize::OutputArchive& archive) const {
    archive.write("processes", c10::IValue(processes));
    archive.write("placement", c10::IValue(placement));
    for (std::size_t j = 0; j < signatures.size(); ++j) {
      archive.write("signature" + std::to_string(j), c10::IValue(signatures[j]));
      archive.write("device" + std::to_string(j), c10::IValue(devices[j]));
    }
  }

  static SavedPlan read(torch::serialize::InputArchive& archive) {
    SavedPlan p;
    c10::IValue v;
    archive.read("processes", v);
    p.processes = v.toInt();
    archive.read("placement", v);
    p.placement = v.toIntVector();
    for (std::size_t j = 0; j < p.placement.size(); ++j) {
      archive.read("signature" + std::to_string(j), v);
      p.signatures.push_back(v.toStringRef());
      archive.read("device" + std::to_string(j), v);
      p.devices.push_back(v.toStringRef());
    }
    return p;
  }

  /// "" when a pipe with plan `mine` may load a save made with this one; else what differs and
  /// the fix.
  std::string difference(const SavedPlan& mine) const {
    std::ostringstream out;
    if (processes != mine.processes) {
      out << "it was made by " << processes << (processes == 1 ? " process" : " processes")
          << " but this pipe runs in " << mine.processes
          << "; resume with as many ranks as saved it (WORLD_SIZE=" << processes << ")";
    } else if (placement.size() != mine.placement.size()) {
      out << "it has " << placement.size() << " stages but this pipe has " << mine.placement.size()
          << "; build the pipe with the model and balance that made it";
    } else {
      for (std::size_t j = 0; j < placement.size() && out.tellp() == 0; ++j) {
        if (placement[j] != mine.placement[j]) {
          out << "it ran stage " << j << " on rank " << placement[j] << " but this pipe runs it on "
              << "rank " << mine.placement[j]
              << "; build the pipe with the same distributed::Options (virtual_stages, "
                 "placed_like)";
        } else if (signatures[j] != mine.signatures[j]) {
          out << "its stage " << j << " has {" << signatures[j] << "} but this pipe's has {"
              << mine.signatures[j] << "}; build the pipe with the model and balance that made it";
        } else if (devices[j] != mine.devices[j]) {
          out << "it kept stage " << j << " on " << devices[j] << " but this pipe keeps it on "
              << mine.devices[j] << "; build the pipe with the same PipeOptions().devices(...)";
        }
      }
    }
    return out.str();
  }
};

}  // namespace stagewise::detail
