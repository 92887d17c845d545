#pragma once

// A pipe's save and load across its processes (Pipe::save and load, distributed::Pipe's): each
// process writes its files, or reads and checks what its stages need (save_loader.hpp; a save of
// format 1 through format1_save.hpp), and every process agrees on the outcome, so that a failure
// on one fails the save or load on all.

#include "stagewise/core/error_context.hpp"
#include "stagewise/core/rng.hpp"
#include "stagewise/pipe/detail/format1_save.hpp"
#include "stagewise/pipe/detail/save_files.hpp"
#include "stagewise/pipe/detail/save_format.hpp"
#include "stagewise/pipe/detail/save_index.hpp"
#include "stagewise/pipe/detail/save_loader.hpp"

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

/// What a save keeps beside the optimizer (a GradScaler's state), in the archive that holds it:
/// the index (format 2) or the optimizer's archive (format 1).
struct SaveExtras {
  std::function<void(torch::serialize::OutputArchive&)> save = {};
  std::function<void(torch::serialize::InputArchive&)> check = {};  // before anything changes
  std::function<void(torch::serialize::InputArchive&)> load = {};
};

/// A load read and checked on this process, ready to change the pipe.
struct PreparedLoad {
  std::int64_t step = 0;
  std::function<void()> apply;
};

// What a pipe's save and load read of it, for the call (PipeCore::saves()).
struct PipeSaves {
  using Gather = std::function<std::vector<std::string>(const std::string&, const std::string&)>;

  const std::string& who;  // opens errors: "<who>::save: "
  SaveView view;
  bool writes_stage_files = true;  // false on replicas after the first: they only read them
  bool sharded = false;  // replicas shard the optimizer's state: each writes its owned share
  Format1View format1;
  Gather gather;  // every process's `mine` in rank order, under the same `what`

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
      if (static_cast<int>(r) == view.rank) TORCH_CHECK(false, prefix, all[r]);
      TORCH_CHECK(false, prefix, "rank ", r, " failed: ", all[r], "; ", consequence);
    }
  }

  /// Writes this process's part of a save in `dir` (Pipe::save), agrees with the others, then
  /// every process writes the index, which makes the save whole.
  void save(const std::string& dir, std::int64_t step, const SaveOptimizer* optimizer,
            const SaveExtras& extras) const {
    const std::string incomplete = "the save in " + dir + " is incomplete and cannot be loaded";
    std::string failure;
    try {
      std::filesystem::create_directories(dir);
      // Over an older save, the directory is incomplete until the new index is written.
      std::filesystem::remove(save_file(dir, index_name()));
      write_parts(dir, optimizer);
    } catch (const std::exception& e) {
      failure = "could not save to " + dir + ": " + message_of(e);
    }
    agree("save", failure, incomplete);
    try {
      torch::serialize::OutputArchive a;
      index(step, optimizer).write(a);
      if (extras.save) extras.save(a);
      write_whole(a, save_file(dir, index_name()), "." + std::to_string(view.rank));
    } catch (const std::exception& e) {
      failure = "could not save to " + dir + ": " + message_of(e);
    }
    agree("save", failure, incomplete);
  }

  /// Reads and checks this process's part of the save in `dir`, agrees with the others, then
  /// loads it and returns its step (Pipe::load).
  std::int64_t load(const std::string& dir, const SaveOptimizer* optimizer,
                    const SaveExtras& extras) const {
    const std::string where = who + "::load: ";
    PreparedLoad prepared;
    std::string failure;
    try {
      prepared = prepare(dir, where, optimizer, extras);
    } catch (const std::exception& e) {
      failure = message_of(e);
    }
    agree("load", failure, "nothing was loaded");
    const auto steps = gather("load", std::to_string(prepared.step));
    for (std::size_t r = 1; r < steps.size(); ++r) {
      TORCH_CHECK(steps[r] == steps[0], where, "the ranks' saves in ", dir,
                  " are of different steps (rank 0's of step ", steps[0], ", rank ", r,
                  "'s of step ", steps[r],
                  "); resume every rank from the same save. Nothing was loaded");
    }
    try {
      prepared.apply();
    } catch (const std::exception& e) {
      failure = "could not load " + dir + ": " + message_of(e);
    }
    agree("load", failure,
          "this pipe may be partly loaded: load a save again, or build a new pipe");
    return prepared.step;
  }

 private:
  // This process's files: its stages' tensors and optimizer state (unless another replica
  // writes them; sharded, every replica writes the state it owns), then its generators.
  void write_parts(const std::string& dir, const SaveOptimizer* optimizer) const {
    const std::string writer = "." + std::to_string(view.rank);
    for (std::size_t j = 0; j < view.stages.size(); ++j) {
      if (!view.stages[j]) continue;
      const auto tensors = view.tensors_of(j);
      if (writes_stage_files) write_tensors(tensors, j, save_file(dir, stage_name(j)), writer);
      if (!optimizer) continue;
      if (sharded) {
        write_states(tensors, *optimizer, j, save_file(dir, optimizer_name(j, view.replica)),
                     writer);
      } else if (writes_stage_files) {
        write_states(tensors, *optimizer, j, save_file(dir, optimizer_name(j)), writer);
      }
    }
    torch::serialize::OutputArchive a, rng;
    a.write("format", c10::IValue(kSaveFormat));
    a.write("rank", c10::IValue(static_cast<std::int64_t>(view.rank)));
    RngState::capture_all().save(rng);
    a.write("rng", rng);
    write_whole(a, save_file(dir, rank_name(view.rank)), writer);
  }

  // The index of a save of this pipe: the first replica's files hold every stage.
  SaveIndex index(std::int64_t step, const SaveOptimizer* optimizer) const {
    SaveIndex x;
    x.step = step;
    x.plan = view.plan;
    x.entries = view.entries;
    for (std::size_t j = 0; j < view.entries.size(); ++j) {
      x.files.push_back({stage_name(j)});
      std::vector<std::string> states;
      if (optimizer && sharded) {
        for (int i = 0; i < view.plan.replicas; ++i) states.push_back(optimizer_name(j, i));
      } else if (optimizer) {
        states.push_back(optimizer_name(j));
      }
      x.state_files.push_back(std::move(states));
    }
    for (std::int64_t r = 0; r < view.plan.processes; ++r) {
      x.rank_files.push_back(rank_name(static_cast<int>(r)));
    }
    x.has_optimizer = optimizer != nullptr;
    if (optimizer) x.optimizer_kind = optimizer->kind;
    return x;
  }

  // Reads `path` with `read`: an error of LibTorch's reader (a file cut short or damaged) names
  // the file, the save and the fix; stagewise's own checks (opening with `where`) pass as they
  // are.
  static SaveReading reading(const std::string& where, const std::string& dir) {
    return [where, dir](const std::string& path, const std::function<void()>& read) {
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
  }

  PreparedLoad prepare(const std::string& dir, const std::string& where,
                       const SaveOptimizer* optimizer, const SaveExtras& extras) const;
  PreparedLoad prepare_index(const std::string& dir, const std::string& where,
                             const SaveOptimizer* optimizer, const SaveExtras& extras) const;
  PreparedLoad prepare_rank_file(const std::string& dir, const std::string& where,
                                 const SaveOptimizer* optimizer, const SaveExtras& extras) const;
};

// "<file> has save format N, ..." for a file of a newer stagewise.
inline void refuse_newer_format(std::int64_t format, const std::string& where,
                                const std::string& path) {
  TORCH_CHECK(format <= kSaveFormat, where, path, " has save format ", format,
              "; this stagewise reads formats 1 to ", kSaveFormat,
              ": load it with the stagewise that wrote it, or a newer one");
}

// A save of format 2 (its index is there) or 1 (this process's rank file is), read and checked.
inline PreparedLoad PipeSaves::prepare(const std::string& dir, const std::string& where,
                                       const SaveOptimizer* optimizer,
                                       const SaveExtras& extras) const {
  if (std::filesystem::exists(save_file(dir, index_name()))) {
    return prepare_index(dir, where, optimizer, extras);
  }
  return prepare_rank_file(dir, where, optimizer, extras);
}

inline PreparedLoad PipeSaves::prepare_index(const std::string& dir, const std::string& where,
                                             const SaveOptimizer* optimizer,
                                             const SaveExtras& extras) const {
  const auto path = save_file(dir, index_name());
  auto index = std::make_shared<torch::serialize::InputArchive>();
  reading(where, dir)(path, [&] {
    index->load_from(path);
    c10::IValue v;
    index->read("format", v);
    refuse_newer_format(v.toInt(), where, path);
  });
  auto load = std::make_shared<Format2Load>(
      prepare_format2(view, where, dir, *index, optimizer, extras.check, reading(where, dir)));
  return {load->step, [load, index, optimizer, load_extras = extras.load] {
            {
              torch::NoGradGuard no_grad;
              for (auto& [target, saved] : load->tensors) torch::Tensor(target).copy_(saved);
            }
            for (auto& [param, state] : load->states) optimizer->load(param, state);
            load->rng.restore();
            if (load_extras) load_extras(*index);
          }};
}

inline PreparedLoad PipeSaves::prepare_rank_file(const std::string& dir, const std::string& where,
                                                 const SaveOptimizer* optimizer,
                                                 const SaveExtras& extras) const {
  const auto path = save_file(dir, rank_name(view.rank));
  TORCH_CHECK(std::filesystem::exists(path), where, dir, " has no ", save_file(dir, index_name()),
              ": it is not a save, or the job stopped while saving; resume from an earlier save");
  auto archive = std::make_shared<torch::serialize::InputArchive>();
  std::int64_t format = 0;
  reading(where, dir)(path, [&] {
    archive->load_from(path);
    c10::IValue v;
    archive->read("format", v);
    format = v.toInt();
  });
  refuse_newer_format(format, where, path);
  TORCH_CHECK(format == kFormat1, where, dir, " has no ", save_file(dir, index_name()),
              ": the job stopped while saving; resume from an earlier save");
  TORCH_CHECK(!optimizer || optimizer->load_whole, where, "the save in ", dir,
              " (save format 1) holds the optimizer's own archive, which only a LibTorch "
              "optimizer or optim::FusedStep reads; load it with one of those");
  auto load = std::make_shared<Format1Load>(prepare_format1(format1, where, dir, path, *archive,
                                                            optimizer != nullptr, extras.check,
                                                            reading(where, dir)));
  return {load->step, [load, optimizer, load_extras = extras.load] {
            for (const auto& m : load->modules) {
              if (m) m->copy_into();
            }
            if (optimizer) optimizer->load_whole(load->optimizer);
            load->rng.restore();
            if (load_extras) load_extras(load->optimizer);
          }};
}

}  // namespace stagewise::detail
