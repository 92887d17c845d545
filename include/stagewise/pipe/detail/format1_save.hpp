#pragma once

// Saves of format 1 (stagewise before format 2: a stage<j>.pt per stage and a rank<r>.pt per
// process, holding the optimizer's own archive), which users already have: read into a pipe of
// the plan that made them (the same stages, placement, devices and number of processes), else
// refused, naming the difference and the fix. This stagewise writes format 2 (save_format.hpp).

#include "stagewise/core/rng.hpp"
#include "stagewise/runtime/stage_runtime.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

inline constexpr std::int64_t kFormat1 = 1;

inline std::string format1_stage_file(const std::string& dir, std::size_t stage) {
  return (std::filesystem::path(dir) / ("stage" + std::to_string(stage) + ".pt")).string();
}

/// A stage's defined parameters, then its defined buffers, by their names in the stage.
inline std::vector<std::pair<std::string, torch::Tensor>> format1_tensors(
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

/// A stage's saved tensors (format 1), read and checked against `module` (names, shapes,
/// dtypes) without changing it; `copy_into` then copies them into its parameters and buffers in
/// place (the tensors keep their storage, so optimizers and hooks holding them see the loaded
/// values).
class Format1Module {
 public:
  Format1Module(const torch::nn::Module& module, torch::serialize::InputArchive& archive,
                const std::string& file) {
    const auto mine = format1_tensors(module);
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
    for (const auto& [target, saved] : tensors_) torch::Tensor(target).copy_(saved);
  }

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> tensors_;  // (the stage's, the saved)
};

/// What made a format-1 save, and what a pipe loading it must have alike: the number of
/// processes, the process of every stage, every stage's signature (parameter names, dtypes,
/// shapes) and the device of each of this process's stages ("" for another process's).
struct Format1Plan {
  std::int64_t processes = 1;
  std::vector<std::int64_t> placement;
  std::vector<std::string> signatures;
  std::vector<std::string> devices;

  static Format1Plan read(torch::serialize::InputArchive& archive) {
    Format1Plan p;
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
  std::string difference(const Format1Plan& mine) const {
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

/// A format-1 load, read and checked, ready to apply.
struct Format1Load {
  std::int64_t step = 0;
  std::vector<std::unique_ptr<Format1Module>> modules;  // per stage; null: not this process's
  torch::serialize::InputArchive optimizer;             // the optimizer's own archive
  RngState rng;
};

/// What a format-1 load reads of the pipe loading it.
struct Format1View {
  const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages;  // null: another process's
  const std::vector<std::string>& signatures;                         // of every stage
  Format1Plan plan;                                                   // this pipe's
};

/// Reads and checks this process's part of the format-1 save in `dir` (`rank_archive`: its
/// rank<r>.pt, read), changing nothing. `reading(path, read)` runs `read`, naming `path` and the
/// save in any error of LibTorch's reader. `with_optimizer`: the optimizer's archive is needed;
/// `check`, if given, is called on it (a scaler's state is there too).
inline Format1Load prepare_format1(
    const Format1View& pipe, const std::string& where, const std::string& dir,
    const std::string& rank_file, torch::serialize::InputArchive& rank_archive, bool with_optimizer,
    const std::function<void(torch::serialize::InputArchive&)>& check,
    const std::function<void(const std::string&, const std::function<void()>&)>& reading) {
  Format1Load out;
  out.modules.resize(pipe.stages.size());
  c10::IValue v;
  torch::serialize::InputArchive rng;
  reading(rank_file, [&] {
    rank_archive.read("step", v);
    out.step = v.toInt();
    torch::serialize::InputArchive plan;
    rank_archive.read("plan", plan);
    const auto difference = Format1Plan::read(plan).difference(pipe.plan);
    TORCH_CHECK(difference.empty(), where, "cannot load the save in ", dir,
                " (save format 1, which loads only under the plan that made it): ", difference,
                "; or load it with the pipe that made it and save it again: a save of format ",
                kFormat1 + 1, " loads under any plan");
    rank_archive.read("has_optimizer", v);
    TORCH_CHECK(!with_optimizer || v.toBool(), where, "the save in ", dir,
                " has no optimizer state (it was saved without an optimizer); load it with "
                "load(dir), or resume from a save made with save(dir, optimizer, step)");
    if (with_optimizer) rank_archive.read("optimizer", out.optimizer);
    if (check) check(out.optimizer);
    rank_archive.read("rng", rng);
  });
  out.rng = RngState::load(rng);
  for (std::size_t j = 0; j < pipe.stages.size(); ++j) {
    if (!pipe.stages[j] || !pipe.stages[j]->spec.module) continue;
    const auto path = format1_stage_file(dir, j);
    TORCH_CHECK(std::filesystem::exists(path), where, dir, " has no ", path,
                ": the save is incomplete; resume from another one");
    reading(path, [&] {
      torch::serialize::InputArchive a;
      a.load_from(path, pipe.stages[j]->device);
      a.read("signature", v);
      TORCH_CHECK(v.toStringRef() == pipe.signatures[j], where, path, " holds stage {",
                  v.toStringRef(), "} but this pipe's stage ", j, " is {", pipe.signatures[j],
                  "}; the files of different saves are mixed in ", dir);
      torch::serialize::InputArchive m;
      a.read("module", m);
      out.modules[j] = std::make_unique<Format1Module>(*pipe.stages[j]->spec.module, m, path);
    });
  }
  return out;
}

}  // namespace stagewise::detail
