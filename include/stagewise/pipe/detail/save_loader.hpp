#pragma once

// A process's part of loading a save of format 2 into a pipe of any plan: the index read and the
// model checked against it, then only the files that hold the names this process's stages need,
// read and checked; nothing changes until `Format2Load::apply`.

#include "stagewise/core/rng.hpp"
#include "stagewise/pipe/detail/save_files.hpp"
#include "stagewise/pipe/detail/save_format.hpp"
#include "stagewise/pipe/detail/save_index.hpp"
#include "stagewise/runtime/stage_runtime.hpp"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

/// What a save reads and writes of the pipe: every stage's entries under the model's names, the
/// stages this process runs, and the plan they run under.
struct SaveView {
  const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages;  // null: another process's
  const std::vector<std::vector<TensorEntry>>& entries;               // of every stage
  const std::vector<std::string>& prefixes;  // per stage: "" (a Sequential's) or "<j>." (typed)
  SavePlan plan;                             // this pipe's
  int rank = 0;                              // this process's, in the job
  int replica = 0;                           // this process's data-parallel replica

  /// The parameters and buffers of this process's stage j under the model's names.
  std::vector<std::pair<TensorEntry, torch::Tensor>> tensors_of(std::size_t j) const {
    if (!stages[j] || !stages[j]->spec.module) return {};
    return named_tensors(*stages[j]->spec.module, prefixes[j]);
  }
};

/// "" if `saved` is a save of this model (the same names, each of the same kind, dtype and
/// shape, and as many layers), else the first difference.
inline std::string model_difference(const SaveIndex& saved, const SaveView& pipe) {
  std::ostringstream out;
  std::map<std::string, std::string> theirs, ours;
  for (const auto& stage : saved.entries) {
    for (const auto& e : stage) theirs[e.name] = e.what;
  }
  for (const auto& stage : pipe.entries) {
    for (const auto& e : stage) {
      ours[e.name] = e.what;
      const auto it = theirs.find(e.name);
      if (it == theirs.end()) {
        out << "it holds no '" << e.name << "' (" << e.what << "), which this model has";
      } else if (it->second != e.what) {
        out << "it holds '" << e.name << "' as " << it->second << " where this model has "
            << e.what;
      }
      if (out.tellp() > 0) return out.str();
    }
  }
  for (const auto& stage : saved.entries) {
    for (const auto& e : stage) {
      if (ours.count(e.name) == 0) {
        out << "it holds '" << e.name << "' (" << e.what << "), which this model lacks";
        return out.str();
      }
    }
  }
  if (saved.plan.total_layers() != pipe.plan.total_layers()) {
    out << "its model has " << saved.plan.total_layers() << " layers and this one "
        << pipe.plan.total_layers();
  }
  return out.str();
}

/// Whether a save of `saved` runs under `mine`: the same processes, replicas, placement and split.
inline bool same_plan(const SavePlan& saved, const SavePlan& mine) {
  return saved.processes == mine.processes && saved.replicas == mine.replicas &&
         saved.placement == mine.placement && saved.layers == mine.layers;
}

/// The process of the save whose generators this process restores: under the plan that made the
/// save, its own; under another, the one that ran the first layer of this process's first stage
/// (in the replica of the same number, modulo the saved replicas).
inline std::size_t rng_source(const SaveIndex& saved, const SaveView& pipe) {
  std::int64_t layer = 0;
  for (std::size_t j = 0; j < pipe.stages.size() && !pipe.stages[j]; ++j) {
    layer += pipe.plan.layers[j];
  }
  const auto stage = saved.plan.stage_of_layer(layer);
  const auto replica = pipe.replica % saved.plan.replicas;
  return static_cast<std::size_t>(replica * saved.plan.workers() + saved.plan.placement[stage]);
}

/// A format-2 load, read and checked, ready to apply.
struct Format2Load {
  std::int64_t step = 0;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> tensors;  // (the stage's, the saved)
  std::vector<std::pair<torch::Tensor, torch::serialize::InputArchive>> states;  // (param, state)
  RngState rng;
};

/// What one saved stage gives this process's stages on one device: its parameters and buffers
/// they hold, and which of those need their optimizer state.
struct SavedStageNeeds {
  std::size_t stage = 0;
  c10::Device device = torch::kCPU;
  std::vector<std::pair<TensorEntry, torch::Tensor>> tensors;  // (saved entry, the stage's)
  std::vector<bool> with_state;
};

/// Groups what this process's stages need by the saved stage that holds it and their device.
inline std::vector<SavedStageNeeds> needs_of(const SaveIndex& saved, const SaveView& pipe,
                                             const SaveOptimizer* optimizer) {
  const auto where = saved.locations();
  std::map<std::pair<std::size_t, std::string>, SavedStageNeeds> by_file;
  for (std::size_t j = 0; j < pipe.stages.size(); ++j) {
    for (auto& [entry, tensor] : pipe.tensors_of(j)) {
      const auto [stage, index] = where.at(entry.name);
      auto& needs = by_file[{stage, pipe.stages[j]->device.str()}];
      needs.stage = stage;
      needs.device = pipe.stages[j]->device;
      needs.tensors.emplace_back(saved.entries[stage][index], tensor);
      needs.with_state.push_back(optimizer != nullptr && optimizer->keeps(tensor));
    }
  }
  std::vector<SavedStageNeeds> out;
  for (auto& [key, needs] : by_file) out.push_back(std::move(needs));
  return out;
}

/// Reads `name` from `files` (the first that holds it), or fails naming what is missing.
template <class Read>
auto read_entry(std::vector<std::unique_ptr<SavedFile>>& files, const std::string& name,
                const Read& read, const std::string& missing) {
  for (auto& f : files) {
    if (f->has(name)) return read(*f);
  }
  TORCH_CHECK(false, missing);
}

/// Runs a read of file `path` of the save, naming the file, the save and the fix in an error of
/// LibTorch's reader (a file cut short or damaged); stagewise's own checks name them already.
using SaveReading = std::function<void(const std::string& path, const std::function<void()>&)>;

/// Reads what this process's stages need from one saved stage (`needs`) into `out`.
class StageReader {
 public:
  StageReader(const SaveIndex& saved, const std::string& where, const std::string& dir,
              const SaveReading& reading)
      : saved_(saved), where_(where), dir_(dir), reading_(reading) {}

  void read(const SavedStageNeeds& needs, Format2Load& out) const {
    auto tensors = open(needs, saved_.files[needs.stage], kTensorsFile);
    bool any_state = false;
    for (std::size_t i = 0; i < needs.tensors.size(); ++i) {
      const auto& [entry, target] = needs.tensors[i];
      reading_(tensors.front()->path(), [&] {
        out.tensors.emplace_back(
            target, read_entry(
                        tensors, entry.name, [&](SavedFile& f) { return f.tensor(entry); },
                        where_ + "the files of stage " + std::to_string(needs.stage) + " of " +
                            dir_ + " hold no '" + entry.name +
                            "', which its index lists; the save is damaged: resume from another"));
      });
      any_state = any_state || needs.with_state[i];
    }
    if (!any_state) return;
    auto states = open(needs, saved_.state_files[needs.stage], kStatesFile);
    for (const auto& f : states) {
      TORCH_CHECK(f->kind() == saved_.optimizer_kind, where_, f->path(), " holds ", f->kind(),
                  " state where its index says ", saved_.optimizer_kind,
                  "; the files of different saves are mixed: resume from a save written whole");
    }
    for (std::size_t i = 0; i < needs.tensors.size(); ++i) {
      if (!needs.with_state[i]) continue;
      const auto& [entry, target] = needs.tensors[i];
      reading_(states.front()->path(), [&] {
        out.states.emplace_back(
            target,
            read_entry(
                states, entry.name, [&](SavedFile& f) { return f.state(entry.name); },
                where_ + "the save in " + dir_ + " has no optimizer state for '" + entry.name +
                    "' (the optimizer that saved it did not hold it); give the optimizer "
                    "without it, or resume from a save whose optimizer held it"));
      });
    }
  }

 private:
  // The files `names` of the saved stage, read onto the needs' device.
  std::vector<std::unique_ptr<SavedFile>> open(const SavedStageNeeds& needs,
                                               const std::vector<std::string>& names,
                                               const char* holds) const {
    TORCH_CHECK(!names.empty(), where_, "the index of the save in ", dir_, " lists no file of ",
                holds, " of its stage ", needs.stage, "; the save is damaged: resume from another");
    std::vector<std::unique_ptr<SavedFile>> files;
    for (const auto& name : names) {
      const auto path = save_file(dir_, name);
      TORCH_CHECK(std::filesystem::exists(path), where_, dir_, " has no ", path, " (", holds,
                  " of its stage ", needs.stage,
                  "): the save is incomplete, or not all its files are here (a save loads under "
                  "another plan where every process sees all its files: a file system they "
                  "share, or a copy of the whole save on each machine)");
      reading_(path, [&] {
        files.push_back(
            std::make_unique<SavedFile>(where_, path, needs.device, needs.stage, holds));
      });
    }
    return files;
  }

  const SaveIndex& saved_;
  const std::string& where_;
  const std::string& dir_;
  const SaveReading& reading_;
};

/// The generators this process restores (rng_source's), read from the save in `dir`.
inline RngState read_generators(const SaveIndex& saved, const SaveView& pipe,
                                const std::string& where, const std::string& dir,
                                const SaveReading& reading) {
  const auto source = rng_source(saved, pipe);
  TORCH_CHECK(source < saved.rank_files.size(), where, "the index of the save in ", dir, " lists ",
              saved.rank_files.size(), " processes' generators, not process ", source,
              "'s; the save is damaged: resume from another");
  const auto path = save_file(dir, saved.rank_files[source]);
  TORCH_CHECK(std::filesystem::exists(path), where, dir, " has no ", path,
              " (the generators of its process ", source,
              "): the save is incomplete, or not all its files are here");
  torch::serialize::InputArchive rng;
  reading(path, [&] {
    torch::serialize::InputArchive a;
    a.load_from(path);
    c10::IValue v;
    a.read("format", v);
    TORCH_CHECK(v.toInt() == kSaveFormat, where, path, " has save format ", v.toInt(),
                " where its index has ", kSaveFormat,
                "; the files of different saves are mixed: resume from a save written whole");
    a.read("rng", rng);
  });
  // Under another plan the saving process may have seen other devices: their states are left
  // out. Under the same plan they must all be here, for the job to go on bit for bit.
  return RngState::load(rng, /*only_present=*/!same_plan(saved.plan, pipe.plan));
}

/// Reads and checks this process's part of the save in `dir` (its index read into `index`),
/// changing nothing: the model against the index, then the files holding what this process's
/// stages need, and the generators it restores. `optimizer`: the optimizer to load (null: none);
/// `check`, if given, is called on the index (a GradScaler's state is there).
inline Format2Load prepare_format2(
    const SaveView& pipe, const std::string& where, const std::string& dir,
    torch::serialize::InputArchive& index, const SaveOptimizer* optimizer,
    const std::function<void(torch::serialize::InputArchive&)>& check, const SaveReading& reading) {
  Format2Load out;
  SaveIndex saved;
  reading(save_file(dir, index_name()), [&] {
    saved = SaveIndex::read(index);
    if (check) check(index);
  });
  out.step = saved.step;
  const auto difference = model_difference(saved, pipe);
  TORCH_CHECK(difference.empty(), where, "cannot load the save in ", dir,
              ": it is a save of another model: ", difference,
              "; build the model that made it (its layers, their parameters and buffers)");
  if (optimizer != nullptr) {
    TORCH_CHECK(saved.has_optimizer, where, "the save in ", dir,
                " has no optimizer state (it was saved without an optimizer); load it with "
                "load(dir), or resume from a save made with save(dir, optimizer, step)");
    TORCH_CHECK(saved.optimizer_kind == optimizer->kind, where, "the save in ", dir,
                " holds the state of ", saved.optimizer_kind, " but this optimizer keeps ",
                optimizer->kind, "; resume with the optimizer that made it (fused or not)");
  }
  const StageReader reader(saved, where, dir, reading);
  for (const auto& needs : needs_of(saved, pipe, optimizer)) reader.read(needs, out);
  out.rng = read_generators(saved, pipe, where, dir, reading);
  return out;
}

}  // namespace stagewise::detail
