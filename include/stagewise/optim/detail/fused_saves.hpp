#pragma once

// FusedStep's saves: its whole state in the unfused optimizer's layout (save, load: one optimizer
// over every parameter) and one parameter's in LibTorch's one-parameter layout (save_state,
// load_state: what a pipe's save files under the parameter's name), each parameter's state taken
// from its own optimizer or, when offloaded (FusedStep::offload_state), from its StateOffload, and
// put back the same way.

#include "stagewise/optim/detail/fused_slot.hpp"
#include "stagewise/optim/detail/one_parameter.hpp"
#include "stagewise/optim/parameter_state.hpp"

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <memory>
#include <sstream>
#include <utility>
#include <vector>

namespace stagewise::detail {

// One optimizer over every parameter, with the current options and no state: the unfused layout.
inline std::unique_ptr<torch::optim::Optimizer> combined_optimizer(const FusedState& st) {
  std::vector<torch::Tensor> params;
  for (const auto& slot : st.slots) params.push_back(slot->param);
  auto combined = st.factory(params);
  TORCH_CHECK(combined && combined->param_groups().size() == 1,
              "stagewise::optim::FusedStep: the optimizer factory must return an optimizer "
              "with one param group holding exactly the parameters it is given.");
  combined->param_groups()[0].set_options(
      st.slots.front()->optimizer->param_groups()[0].options().clone());
  combined->state().clear();
  return combined;
}

// Every parameter's state (an offloaded one's from its store), in the unfused optimizer's layout.
inline void save_fused(const FusedState& st, torch::serialize::OutputArchive& archive) {
  auto combined = combined_optimizer(st);
  for (const auto& slot : st.slots) {
    if (slot->offloaded) {
      if (auto s = st.offload->state(slot->index)) {
        combined->state()[optimizer_state_key(slot->param)] = std::move(s);
      }
      continue;
    }
    // Same tensor, same key: the entries move over as they are (clone() shares the tensors).
    for (const auto& [key, param_state] : slot->optimizer->state()) {
      combined->state()[key] = param_state->clone();
    }
  }
  combined->save(archive);
}

// Loads state saved by save_fused or by the unfused optimizer over the same parameters (an
// offloaded parameter's into its store).
// Sharded over data-parallel replicas, it keeps the owned parameters' state only, and refuses
// an archive that holds state for others but none for an owned one.
inline void load_fused(FusedState& st, torch::serialize::InputArchive& archive) {
  auto combined = combined_optimizer(st);
  combined->load(archive);
  const auto& options = combined->param_groups()[0].options();
  if (!st.owned.empty() && !combined->state().empty()) {
    std::ostringstream missing;
    int count = 0;
    for (const auto& slot : st.slots) {
      if (!st.owns(slot->index)) continue;
      if (combined->state().count(optimizer_state_key(slot->param)) == 0) {
        missing << (count++ ? ", " : "") << slot->describe();
      }
    }
    TORCH_CHECK(count == 0,
                "stagewise::optim::FusedStep::load: the archive holds optimizer state, but none "
                "for ",
                missing.str(),
                ", which this replica owns; it was saved by another replica or for another "
                "model. Load each replica's own save (same model, same replica count), or an "
                "unsharded optimizer's; nothing was loaded");
  }
  for (auto& slot : st.slots) {
    auto& map = slot->optimizer->state();
    map.clear();
    const auto key = optimizer_state_key(slot->param);
    auto it = combined->state().find(key);
    const bool saved = it != combined->state().end() && st.owns(slot->index);
    if (slot->offloaded) {
      st.offload->set_state(slot->index, saved ? std::move(it->second) : nullptr);
    } else if (saved) {
      map[key] = std::move(it->second);
    }
    slot->optimizer->param_groups()[0].set_options(options.clone());
  }
}

// One parameter's state, as optim::save_state writes it (an offloaded one's from its store).
inline bool save_slot(const FusedState& st, const FusedSlot& slot,
                      torch::serialize::OutputArchive& archive) {
  if (!slot.offloaded) return optim::save_state(*slot.optimizer, slot.param, archive);
  const auto s = st.offload->state(slot.index);
  write_one_parameter(slot.optimizer->param_groups()[0].options(), s.get(), archive);
  return true;
}

// Replaces one parameter's state with what save_slot (or optim::save_state) wrote; an offloaded
// one's goes to its store, and leaves its optimizer without state.
inline void load_slot(FusedState& st, FusedSlot& slot, torch::serialize::InputArchive& archive) {
  optim::load_state(*slot.optimizer, slot.param, archive);
  if (!slot.offloaded) return;
  auto& map = slot.optimizer->state();
  auto it = map.find(optimizer_state_key(slot.param));
  try {
    st.offload->set_state(slot.index, it != map.end() ? it->second->clone() : nullptr);
  } catch (...) {
    map.clear();
    throw;
  }
  map.clear();
}

}  // namespace stagewise::detail
