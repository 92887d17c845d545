#pragma once

// The index of a pipe's save (index.pt, format 2): the step, the plan that made it, every
// stage's parameters and buffers under the model's names, which files hold them and their
// optimizer state (and a GradScaler's state, when saved with one). Every process writes it once
// every process's files are whole, so its presence says the save is complete; a load reads it
// first and then only the files that hold the names its stages need.

#include "stagewise/pipe/detail/save_format.hpp"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace stagewise::detail {

// A list of texts as an IValue.
inline c10::IValue text_list(const std::vector<std::string>& texts) {
  return c10::IValue(c10::List<std::string>(texts));
}

struct SaveIndex {
  std::int64_t format = kSaveFormat;
  std::int64_t step = 0;
  SavePlan plan;
  std::vector<std::vector<TensorEntry>> entries;      // per stage
  std::vector<std::vector<std::string>> files;        // per stage: its parameters and buffers
  std::vector<std::vector<std::string>> state_files;  // per stage: its optimizer state
  std::vector<std::string> rank_files;                // per process: its generators
  bool has_optimizer = false;
  std::string optimizer_kind;  // optim::state_kind of the optimizer that saved

  /// Where each name is: its stage and index there.
  std::map<std::string, std::pair<std::size_t, std::size_t>> locations() const {
    std::map<std::string, std::pair<std::size_t, std::size_t>> out;
    for (std::size_t j = 0; j < entries.size(); ++j) {
      for (std::size_t i = 0; i < entries[j].size(); ++i) out[entries[j][i].name] = {j, i};
    }
    return out;
  }

  /// Writes the index (a GradScaler's state goes beside it: scaled_step.hpp's save_scaler).
  void write(torch::serialize::OutputArchive& a) const {
    a.write("format", c10::IValue(format));
    a.write("step", c10::IValue(step));
    a.write("processes", c10::IValue(plan.processes));
    a.write("replicas", c10::IValue(plan.replicas));
    a.write("placement", c10::IValue(plan.placement));
    a.write("layers", c10::IValue(plan.layers));
    for (std::size_t j = 0; j < entries.size(); ++j) {
      const auto s = std::to_string(j);
      std::vector<std::string> names, what;
      for (const auto& e : entries[j]) {
        names.push_back(e.name);
        what.push_back(e.what);
      }
      a.write("names" + s, text_list(names));
      a.write("what" + s, text_list(what));
      a.write("files" + s, text_list(files[j]));
      a.write("state_files" + s, text_list(state_files[j]));
    }
    a.write("rank_files", text_list(rank_files));
    a.write("has_optimizer", c10::IValue(has_optimizer));
    a.write("optimizer_kind", c10::IValue(optimizer_kind));
  }

  /// Reads an index written by `write` (after its "format" entry was checked).
  static SaveIndex read(torch::serialize::InputArchive& a) {
    SaveIndex x;
    c10::IValue v;
    auto read_int = [&](const char* key) {
      a.read(key, v);
      return v.toInt();
    };
    auto read_strings = [&](const std::string& key) {
      a.read(key, v);
      std::vector<std::string> out;
      for (const c10::IValue& s : v.toListRef()) out.push_back(s.toStringRef());
      return out;
    };
    x.format = read_int("format");
    x.step = read_int("step");
    x.plan.processes = read_int("processes");
    x.plan.replicas = read_int("replicas");
    a.read("placement", v);
    x.plan.placement = v.toIntVector();
    a.read("layers", v);
    x.plan.layers = v.toIntVector();
    for (std::size_t j = 0; j < x.plan.placement.size(); ++j) {
      const auto s = std::to_string(j);
      const auto names = read_strings("names" + s), what = read_strings("what" + s);
      TORCH_CHECK(names.size() == what.size(), "its stage ", j, " lists ", names.size(),
                  " names but ", what.size(), " descriptions");
      x.entries.emplace_back();
      for (std::size_t i = 0; i < names.size(); ++i)
        x.entries.back().push_back({names[i], what[i]});
      x.files.push_back(read_strings("files" + s));
      x.state_files.push_back(read_strings("state_files" + s));
    }
    x.rank_files = read_strings("rank_files");
    a.read("has_optimizer", v);
    x.has_optimizer = v.toBool();
    a.read("optimizer_kind", v);
    x.optimizer_kind = v.toStringRef();
    return x;
  }
};

}  // namespace stagewise::detail
