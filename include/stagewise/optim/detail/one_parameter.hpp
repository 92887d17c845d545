#pragma once

// One parameter's state in a torch::optim optimizer, as optim/parameter_state.hpp saves and loads
// it: LibTorch's own optimizer archive with that parameter alone in it (written here), and the
// optimizer's own load run with that parameter alone in its groups (AloneInGroups).

#include "stagewise/optim/detail/fused_slot.hpp"

#include <c10/util/Exception.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise::detail {

// The key the one parameter is filed under: a number, which LibTorch 2.x parses back
// (std::stoull) and 1.x compares as text, so either version reads what either wrote.
inline constexpr const char* kOneParameterKey = "1";

// The group of `optimizer` that holds `param`, or null.
inline const torch::optim::OptimizerParamGroup* group_of(const torch::optim::Optimizer& optimizer,
                                                         const torch::Tensor& param) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.is_same(param)) return &group;
    }
  }
  return nullptr;
}

// LBFGS keeps one history over all its parameters (flat vectors), which no per-parameter entry
// can hold.
inline void refuse_lbfgs(const torch::optim::Optimizer& optimizer, const char* what) {
  TORCH_CHECK(dynamic_cast<const torch::optim::LBFGS*>(&optimizer) == nullptr,
              "stagewise::optim::", what,
              ": torch::optim::LBFGS keeps one history over all its parameters, which cannot be "
              "saved parameter by parameter; save it yourself (torch::save(lbfgs, file)) and the "
              "pipe with save(dir, step)");
}

// Writes the archive `torch::optim` writes for an optimizer of one group holding one parameter
// with `options` and `state` (null: the parameter never stepped): LibTorch's layout since 1.5
// (torch/optim/serialize.h), which every built-in optimizer but LBFGS loads.
inline void write_one_parameter(const torch::optim::OptimizerOptions& options,
                                const torch::optim::OptimizerParamState* state,
                                torch::serialize::OutputArchive& out) {
  const auto unit = out.compilation_unit();
  out.write("pytorch_version", c10::IValue("1.5.0"));
  torch::serialize::OutputArchive states(unit), groups(unit), group(unit), group_options(unit);
  if (state != nullptr) {
    torch::serialize::OutputArchive one(unit);
    state->serialize(one);
    states.write(kOneParameterKey, one);
  }
  out.write("state", states);
  groups.write("param_groups/size", torch::tensor(static_cast<std::int64_t>(1)));
  group.write("params/size", torch::tensor(static_cast<std::int64_t>(1)));
  group.write("params/0", c10::IValue(std::string(kOneParameterKey)));
  options.serialize(group_options);
  group.write("options", group_options);
  groups.write("param_groups/0", group);
  out.write("param_groups", groups);
}

// While it lives, `optimizer` holds only `param`, in one group with the options of its own group,
// and no state: its own load then reads a one-parameter archive into `param`'s state and touches
// nothing else. `take()` keeps what the load left for `param`; the destructor puts the groups and
// every other parameter's state back (whatever the load did, thrown or not).
class AloneInGroups {
 public:
  using Optimizer = torch::optim::Optimizer;
  using State = std::remove_cvref_t<decltype(std::declval<Optimizer&>().state())>;

  // `options`: a copy of the options of `param`'s group.
  AloneInGroups(Optimizer& optimizer, const torch::Tensor& param,
                std::unique_ptr<torch::optim::OptimizerOptions> options)
      : optimizer_(optimizer),
        param_(param),
        groups_(std::move(optimizer.param_groups())),
        state_(std::move(optimizer.state())) {
    optimizer.param_groups().clear();
    optimizer.state().clear();
    optimizer.param_groups().emplace_back(std::vector<torch::Tensor>{param}, std::move(options));
  }
  ~AloneInGroups() {
    auto loaded = std::move(optimizer_.state());
    optimizer_.param_groups() = std::move(groups_);
    optimizer_.state() = std::move(state_);
    if (!took_) return;
    const auto key = optimizer_state_key(param_);
    auto it = loaded.find(key);
    if (it != loaded.end() && it->second) {
      optimizer_.state()[key] = std::move(it->second);
    } else {
      optimizer_.state().erase(key);  // saved without state: it never stepped
    }
  }
  AloneInGroups(const AloneInGroups&) = delete;
  AloneInGroups& operator=(const AloneInGroups&) = delete;

  /// The load succeeded: `param`'s state becomes what it read.
  void take() { took_ = true; }

 private:
  Optimizer& optimizer_;
  torch::Tensor param_;
  std::vector<torch::optim::OptimizerParamGroup> groups_;
  State state_;
  bool took_ = false;
};

}  // namespace stagewise::detail
