#pragma once

// A pipe's save and load across its processes (Pipe::save and load, distributed::Pipe's): each
// process writes or checks its own files (saved_state.hpp), and every process agrees on the
// outcome, so that a failure on one fails the save or load on all.

#include "stagewise/core/error_context.hpp"
#include "stagewise/core/rng.hpp"
#include "stagewise/pipe/detail/saved_state.hpp"
#include "stagewise/runtime/stage_runtime.hpp"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace stagewise::detail {

// What a pipe's save and load read of it, for the call (PipeOver::saves()).
struct PipeSaves {
  using SaveOptimizer = std::function<void(torch::serialize::OutputArchive&)>;
  using LoadOptimizer = std::function<void(torch::serialize::InputArchive&)>;

  const std::string& who;  // opens errors: "<who>::save: "
  const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages;  // null: another process's
  const std::vector<std::string>& signatures;                         // of every stage
  int rank = 0;                                                       // this process's
  bool writes_stage_files = true;  // false on replicas after the first: they only read them
  SavedPlan plan_here;             // this process's
  // Every process's `mine` in rank order, under the same `what` (PipeOver::gather).
  std::function<std::vector<std::string>(const std::string&, const std::string&)> gather;

  // Every process's outcome of `what` (`failure`: this one's error, opening with
  // "<who>::<what>: ", or empty); throws the first failure, in rank order, on every process: a
  // c10::Error with this process's own text if it is that one, else naming the failed rank.
  void agree(const std::string& what, const std::string& failure,
             const std::string& consequence) const {
    const std::string prefix = who + "::" + what + ": ";
    std::string published = failure;
    if (published.rfind(prefix, 0) == 0) published.erase(0, prefix.size());
    const auto all = gather(what, published);
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r].empty()) continue;
      if (static_cast<int>(r) == rank) TORCH_CHECK(false, prefix, all[r]);
      TORCH_CHECK(false, prefix, "rank ", r, " failed: ", all[r], "; ", consequence);
    }
  }

  /// Writes this process's part of a save in `dir` (Pipe::save), then agrees with the others.
  void save(const std::string& dir, std::int64_t step, const SaveOptimizer& optimizer) const {
    std::string failure;
    try {
      std::filesystem::create_directories(dir);
      for (std::size_t j = 0; j < stages.size(); ++j) {
        if (!stages[j] || !writes_stage_files) continue;
        torch::serialize::OutputArchive a;
        a.write("format", c10::IValue(kSaveFormat));
        a.write("stage", c10::IValue(static_cast<std::int64_t>(j)));
        a.write("signature", c10::IValue(signatures[j]));
        if (const auto& module = stages[j]->spec.module) {
          torch::serialize::OutputArchive m;
          write_module_state(*module, m);
          a.write("module", m);
        }
        write_whole(a, stage_file(dir, static_cast<int>(j)));
      }
      // The process's file last: its presence says this process's part of the save is whole.
      torch::serialize::OutputArchive a, plan, rng;
      a.write("format", c10::IValue(kSaveFormat));
      a.write("step", c10::IValue(step));
      plan_here.write(plan);
      a.write("plan", plan);
      RngState::capture_all().save(rng);
      a.write("rng", rng);
      a.write("has_optimizer", c10::IValue(optimizer != nullptr));
      if (optimizer) {
        torch::serialize::OutputArchive o;
        optimizer(o);
        a.write("optimizer", o);
      }
      write_whole(a, rank_file(dir, rank));
    } catch (const std::exception& e) {
      failure = "could not save to " + dir + ": " + message_of(e);
    }
    agree("save", failure, "the save in " + dir + " is incomplete and cannot be loaded");
  }

  /// Reads and checks this process's part of the save in `dir`, agrees with the others, then
  /// loads it and returns its step (Pipe::load).
  /// `check`, if given, is called on the saved optimizer state while checking (a scaler's state
  /// is there too: detail/scaled_step.hpp).
  std::int64_t load(const std::string& dir, const LoadOptimizer& optimizer,
                    const LoadOptimizer& check = nullptr) const {
    // First read and check everything, changing nothing; every process then knows whether all
    // can load, and from the same step.
    const std::string where = who + "::load: ";
    const std::string file = rank_file(dir, rank);
    torch::serialize::InputArchive rank_archive, optimizer_archive, rng_archive;
    std::vector<std::unique_ptr<SavedModuleState>> modules(stages.size());
    std::int64_t step = 0;
    std::string failure;
    // Reads from the save file `path` with `read`: an error of LibTorch's reader (a file cut
    // short or damaged) names the file, the save and the fix; stagewise's own checks name the
    // file already.
    const auto reading = [&](const std::string& path, const auto& read) {
      try {
        read();
      } catch (const std::exception& e) {
        const std::string text = message_of(e);
        if (text.rfind(where, 0) == 0) throw;
        TORCH_CHECK(false, where, "could not read ", path, " of the save in ", dir, ": ", text,
                    ". The file is damaged or cut short (a job killed while writing it, a full "
                    "disk); resume from the previous save");
      }
    };
    try {
      TORCH_CHECK(std::filesystem::exists(file), where, dir, " has no ", file, " (rank ", rank,
                  "'s part of a save): it is not a save, or the job "
                  "stopped while saving; resume from an earlier save");
      c10::IValue v;
      reading(file, [&] {
        rank_archive.load_from(file);
        rank_archive.read("format", v);
        TORCH_CHECK(v.toInt() == kSaveFormat, where, file, " has save format ", v.toInt(),
                    ", this stagewise reads format ", kSaveFormat);
        rank_archive.read("step", v);
        step = v.toInt();
        torch::serialize::InputArchive plan;
        rank_archive.read("plan", plan);
        const auto difference = SavedPlan::read(plan).difference(plan_here);
        TORCH_CHECK(difference.empty(), where, "cannot load the save in ", dir, ": ", difference);
        rank_archive.read("has_optimizer", v);
        TORCH_CHECK(!optimizer || v.toBool(), where, "the save in ", dir,
                    " has no optimizer state (it was saved without an optimizer); load it with "
                    "load(dir), or resume from a save made with save(dir, optimizer, step)");
        if (optimizer) rank_archive.read("optimizer", optimizer_archive);
        if (check) check(optimizer_archive);
        rank_archive.read("rng", rng_archive);
      });
      for (std::size_t j = 0; j < stages.size(); ++j) {
        if (!stages[j] || !stages[j]->spec.module) continue;
        const auto path = stage_file(dir, static_cast<int>(j));
        TORCH_CHECK(std::filesystem::exists(path), where, dir, " has no ", path,
                    ": the save is incomplete; resume from another one");
        reading(path, [&] {
          torch::serialize::InputArchive a;
          a.load_from(path, stages[j]->device);
          a.read("signature", v);
          TORCH_CHECK(v.toStringRef() == signatures[j], where, path, " holds stage {",
                      v.toStringRef(), "} but this pipe's stage ", j, " is {", signatures[j],
                      "}; the files of different saves are mixed in ", dir);
          torch::serialize::InputArchive m;
          a.read("module", m);
          modules[j] = std::make_unique<SavedModuleState>(*stages[j]->spec.module, m, path);
        });
      }
    } catch (const std::exception& e) {
      failure = message_of(e);
    }
    agree("load", failure, "nothing was loaded");
    const auto steps = gather("load", std::to_string(step));
    for (std::size_t r = 1; r < steps.size(); ++r) {
      TORCH_CHECK(steps[r] == steps[0], where, "the ranks' saves in ", dir,
                  " are of different steps (rank 0's of step ", steps[0], ", rank ", r,
                  "'s of step ", steps[r],
                  "); resume every rank from the same save. Nothing was "
                  "loaded");
    }
    // Then change the stages, the optimizer and the generators.
    try {
      for (std::size_t j = 0; j < stages.size(); ++j) {
        if (modules[j]) modules[j]->copy_into();
      }
      if (optimizer) optimizer(optimizer_archive);
      RngState::load(rng_archive).restore();
    } catch (const std::exception& e) {
      failure = "could not load " + dir + ": " + message_of(e);
    }
    agree("load", failure,
          "this pipe may be partly loaded: load a save again, or build a new pipe");
    return step;
  }
};

}  // namespace stagewise::detail
