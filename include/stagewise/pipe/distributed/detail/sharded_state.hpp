#pragma once

// A sharded optimizer's save and load (distributed::Sharded): the archive of the unfused
// optimizer over every parameter, holding state for the ones this replica owns, plus their names;
// and the state a load keeps (the owned parameters'), matched by name when the archive has names
// for another set of parameters, else by place.

#include "stagewise/optim/detail/fused_slot.hpp"

#include <ATen/core/List.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace stagewise::distributed::detail {

using ::stagewise::detail::optimizer_state_key;

// The key of the parameters' names beside the unfused optimizer's own entries (torch::optim's
// load reads only its own keys).
inline constexpr const char* kParameterNames = "stagewise_parameter_names";

using OptimizerOver =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

// Writes `shard` (an optimizer over the owned parameters) as the unfused optimizer `make` builds
// over every one of `params` would save it: its options, state for the owned ones, and the names.
inline void save_shard(const torch::optim::Optimizer& shard, const OptimizerOver& make,
                       const std::vector<torch::Tensor>& params,
                       const std::vector<std::string>& names,
                       torch::serialize::OutputArchive& archive) {
  auto whole = make(params);
  whole->param_groups()[0].set_options(shard.param_groups()[0].options().clone());
  whole->state().clear();
  // The same tensors: the entries keep their keys.
  for (const auto& [key, state] : shard.state()) whole->state()[key] = state->clone();
  whole->save(archive);
  c10::List<std::string> list;
  for (const auto& n : names) list.push_back(n);
  archive.write(kParameterNames, c10::IValue(list));
}

// What a load found: the optimizer's options, and the state of each owned parameter that has
// some (by parameter index).
struct LoadedShard {
  std::unique_ptr<torch::optim::Optimizer> whole;  // holds the options and the states
  std::map<std::size_t, std::unique_ptr<torch::optim::OptimizerParamState>> state;
};

// Reads `archive` (save_shard's, or an unfused optimizer's over the same parameters) and keeps
// the state of the parameters `owned` marks; refuses, changing nothing, an archive of another
// model (another count without names to match by) and one that holds state but none for an
// owned parameter. `who` opens errors.
inline LoadedShard load_shard(torch::serialize::InputArchive& archive, const OptimizerOver& make,
                              const std::vector<torch::Tensor>& params,
                              const std::vector<std::string>& names, const std::vector<char>& owned,
                              const std::string& who) {
  std::vector<std::string> saved;
  c10::IValue v;
  if (archive.try_read(kParameterNames, v)) {
    for (const auto& n : v.to<c10::List<std::string>>()) saved.push_back(n);
  }
  // Where each of `params` is in the archive: by name when it names its parameters, else by
  // place (the same number of parameters).
  std::vector<long> place(params.size(), -1);
  std::vector<torch::Tensor> slots = params;
  if (!saved.empty() && saved != names) {
    slots.clear();
    for (std::size_t k = 0; k < saved.size(); ++k) slots.push_back(torch::empty({0}));
    std::map<std::string, long> where;
    for (std::size_t k = 0; k < saved.size(); ++k) where[saved[k]] = static_cast<long>(k);
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (auto it = where.find(names[i]); it != where.end()) place[i] = it->second;
    }
  } else {
    for (std::size_t i = 0; i < params.size(); ++i) place[i] = static_cast<long>(i);
  }
  LoadedShard out;
  out.whole = make(slots);
  try {
    out.whole->load(archive);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, who, ": the archive is not an optimizer's over these ", params.size(),
                " parameters (", e.what_without_backtrace(),
                "); it was saved for another model or stage; nothing was loaded");
  }
  std::ostringstream missing;
  int count = 0;
  auto& states = out.whole->state();
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!owned[i]) continue;
    auto it = place[i] < 0
                  ? states.end()
                  : states.find(optimizer_state_key(slots[static_cast<std::size_t>(place[i])]));
    if (it == states.end()) {
      missing << (count++ ? ", " : "") << "'" << names[i] << "'";
      continue;
    }
    out.state[i] = std::move(it->second);
  }
  TORCH_CHECK(count == 0 || states.empty(), who,
              ": the archive holds optimizer state, but none "
              "for ",
              missing.str(),
              ", which this replica owns: it was saved by another replica "
              "or for another model. Load each replica's own save (same model and replica count), "
              "or an unsharded optimizer's; nothing was loaded");
  return out;
}

}  // namespace stagewise::distributed::detail
