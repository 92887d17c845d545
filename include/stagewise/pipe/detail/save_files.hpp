#pragma once

// The files of a pipe's save that hold tensors (format 2): a stage's parameters and buffers
// (stage<j>.pt) and their optimizer state (stage<j>.optimizer.pt), each entry under the model's
// name; and the optimizer given to save and load, its type erased (SaveOptimizer).

#include "stagewise/optim/savable_optimizer.hpp"
#include "stagewise/pipe/detail/save_format.hpp"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

/// What a pipe's save and load do with the optimizer given to them (any savable_optimizer).
struct SaveOptimizer {
  std::string kind;  // optim::state_kind
  std::function<bool(const torch::Tensor&)> keeps;
  std::function<bool(const torch::Tensor&, torch::serialize::OutputArchive&)> save;
  std::function<void(const torch::Tensor&, torch::serialize::InputArchive&)> load;
  // Loads the optimizer's own archive of all its state (a format-1 save); null if it has none.
  std::function<void(torch::serialize::InputArchive&)> load_whole;
};

/// A save's view of `o`: its kind and its parameters' state to write.
template <savable_optimizer O>
SaveOptimizer saving(const O& o) {
  SaveOptimizer s;
  s.kind = optim::state_kind(o);
  s.keeps = [&o](const torch::Tensor& p) { return optim::keeps_state(o, p); };
  s.save = [&o](const torch::Tensor& p, torch::serialize::OutputArchive& a) {
    return optim::save_state(o, p, a);
  };
  return s;
}

/// A load's view of `o`: the save's, and the state to read.
template <savable_optimizer O>
SaveOptimizer loading(O& o) {
  SaveOptimizer s = saving(o);
  s.load = [&o](const torch::Tensor& p, torch::serialize::InputArchive& a) {
    optim::load_state(o, p, a);
  };
  if constexpr (requires(torch::serialize::InputArchive & a) { o.load(a); }) {
    s.load_whole = [&o](torch::serialize::InputArchive& a) { o.load(a); };
  }
  return s;
}

// What a file of tensors holds (in its "holds" entry, and in errors that name it).
inline constexpr const char* kTensorsFile = "parameters and buffers";
inline constexpr const char* kStatesFile = "optimizer state";

/// Writes stage `stage`'s parameters and buffers under their names to `path`, whole.
inline void write_tensors(const std::vector<std::pair<TensorEntry, torch::Tensor>>& tensors,
                          std::size_t stage, const std::string& path, const std::string& writer) {
  torch::serialize::OutputArchive a;
  a.write("format", c10::IValue(kSaveFormat));
  a.write("stage", c10::IValue(static_cast<std::int64_t>(stage)));
  a.write("holds", c10::IValue(std::string(kTensorsFile)));
  a.write("count", c10::IValue(static_cast<std::int64_t>(tensors.size())));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto s = std::to_string(i);
    a.write("name" + s, c10::IValue(tensors[i].first.name));
    a.write("tensor" + s, tensors[i].second.detach(), /*is_buffer=*/true);
  }
  write_whole(a, path, writer);
}

/// Writes the optimizer state of stage `stage`'s parameters that `optimizer` keeps, each under
/// its parameter's name, to `path`, whole.
inline void write_states(const std::vector<std::pair<TensorEntry, torch::Tensor>>& tensors,
                         const SaveOptimizer& optimizer, std::size_t stage, const std::string& path,
                         const std::string& writer) {
  torch::serialize::OutputArchive a;
  a.write("format", c10::IValue(kSaveFormat));
  a.write("stage", c10::IValue(static_cast<std::int64_t>(stage)));
  a.write("holds", c10::IValue(std::string(kStatesFile)));
  a.write("kind", c10::IValue(optimizer.kind));
  std::int64_t count = 0;
  for (const auto& [entry, tensor] : tensors) {
    torch::serialize::OutputArchive state;
    if (!optimizer.save(tensor, state)) continue;  // not its parameter (a buffer, a frozen one)
    const auto s = std::to_string(count++);
    a.write("name" + s, c10::IValue(entry.name));
    a.write("state" + s, state);
  }
  a.write("count", c10::IValue(count));
  write_whole(a, path, writer);
}

/// A file of tensors of a save, read whole onto one device: its entries by name. Its checks'
/// errors open with `where` and name the file; LibTorch's own reading errors are left to the
/// caller, who names the save.
class SavedFile {
 public:
  SavedFile(const std::string& where, const std::string& path, const c10::Device& device,
            std::size_t stage, const char* holds)
      : where_(where), path_(path) {
    archive_.load_from(path, device);
    c10::IValue v;
    archive_.read("format", v);
    TORCH_CHECK(v.toInt() == kSaveFormat, where, path, " has save format ", v.toInt(),
                " where its index has ", kSaveFormat, mixed());
    archive_.read("stage", v);
    TORCH_CHECK(v.toInt() == static_cast<std::int64_t>(stage), where, path, " holds stage ",
                v.toInt(), " where its index says stage ", stage, mixed());
    archive_.read("holds", v);
    TORCH_CHECK(v.toStringRef() == holds, where, path, " holds ", v.toStringRef(), ", not ", holds,
                mixed());
    if (archive_.try_read("kind", v)) kind_ = v.toStringRef();
    archive_.read("count", v);
    for (std::int64_t i = 0; i < v.toInt(); ++i) {
      c10::IValue name;
      archive_.read("name" + std::to_string(i), name);
      index_[name.toStringRef()] = i;
    }
  }

  const std::string& path() const { return path_; }
  /// The optimizer's kind of a file of optimizer state.
  const std::string& kind() const { return kind_; }
  bool has(const std::string& name) const { return index_.count(name) > 0; }

  /// The parameter or buffer `name`, checked against `what` (its description in the index).
  torch::Tensor tensor(const TensorEntry& entry) {
    torch::Tensor t;
    archive_.read("tensor" + std::to_string(index_.at(entry.name)), t, /*is_buffer=*/true);
    const bool buffer = entry.what.rfind("buffer ", 0) == 0;
    TORCH_CHECK(describe_tensor(t, buffer) == entry.what, where_, path_, " holds '", entry.name,
                "' as ", describe_tensor(t, buffer), " where its index says ", entry.what, mixed());
    return t;
  }

  /// The optimizer state of parameter `name`.
  torch::serialize::InputArchive state(const std::string& name) {
    torch::serialize::InputArchive s;
    archive_.read("state" + std::to_string(index_.at(name)), s);
    return s;
  }

 private:
  static const char* mixed() {
    return "; the files of different saves are mixed: resume from a save written whole";
  }

  std::string where_;
  std::string path_;
  torch::serialize::InputArchive archive_;
  std::string kind_;
  std::map<std::string, std::int64_t> index_;
};

}  // namespace stagewise::detail
