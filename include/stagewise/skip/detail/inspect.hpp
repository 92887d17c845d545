#pragma once

#include "stagewise/skip/layout.hpp"
#include "stagewise/skip/namespace.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/skip/tracker.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace stagewise::detail {

// One Skippable layer found in a stage's modules, with where it is (for messages).
struct LayerSkips {
  std::size_t stage = 0;
  std::string where;  // "stage 1, layer '3' (PopImpl)"
  const SkipDeclarations* declared = nullptr;
};

// Walks `module` depth first in registration order. A Skippable module speaks for its whole
// subtree (its own declarations are what it stashes and pops); other modules are looked into.
inline void collect_layer_skips(const torch::nn::Module& module, std::size_t stage,
                                const std::string& path, std::vector<LayerSkips>& out) {
  if (const auto* skippable = dynamic_cast<const SkippableBase*>(&module)) {
    std::string where = "stage " + std::to_string(stage);
    if (!path.empty()) where += ", layer '" + path + "'";
    where += " (" + module.name() + ")";
    out.push_back({stage, std::move(where), &skippable->declared_skips()});
    return;
  }
  for (const auto& child : module.named_children()) {
    collect_layer_skips(*child.value(), stage,
                        path.empty() ? child.key() : path + "." + child.key(), out);
  }
}

// Checks the pairing torchgpipe checks, collecting every problem into one message, and returns
// the routes. `layers` are in pipeline order.
inline SkipLayout verify_skip_layers(const std::vector<LayerSkips>& layers,
                                     std::size_t num_stages) {
  auto contains = [](const std::vector<const SkipInfo*>& list, const SkipInfo* s) {
    return std::find(list.begin(), list.end(), s) != list.end();
  };
  std::vector<std::string> problems;
  std::map<const SkipInfo*, std::size_t> stashed_at;
  std::map<const SkipInfo*, std::size_t> popped_at;
  std::vector<const SkipInfo*> stash_order;
  for (std::size_t k = 0; k < layers.size(); ++k) {
    const auto& layer = layers[k];
    const auto& d = *layer.declared;
    for (const auto* s : d.stashes) {
      if (contains(d.pops, s)) {
        problems.push_back(layer.where + " stashes and pops skip " + s->describe() +
                           "; a layer cannot pop its own stash. Keep the tensor in a local "
                           "variable inside the layer instead, or split the layer in two.");
        continue;
      }
      auto [it, fresh] = stashed_at.emplace(s, k);
      if (!fresh) {
        problems.push_back(layer.where + " stashes skip " + s->describe() +
                           " again (first stashed by " + layers[it->second].where +
                           "). Give each stash its own namespace or name.");
        continue;
      }
      stash_order.push_back(s);
    }
    for (const auto* s : d.pops) {
      if (contains(d.stashes, s)) continue;  // reported above
      if (auto it = popped_at.find(s); it != popped_at.end()) {
        problems.push_back(layer.where + " pops skip " + s->describe() +
                           " again (first popped by " + layers[it->second].where +
                           "). Each stash is popped exactly once; pop it in one layer only.");
        continue;
      }
      if (!stashed_at.count(s)) {
        problems.push_back(layer.where + " pops skip " + s->describe() +
                           ", but no earlier layer stashes it. Add stagewise::stashes<...> with "
                           "it to the earlier layer that produces the tensor, or remove the pop.");
        continue;
      }
      popped_at.emplace(s, k);
    }
  }
  for (const auto* s : stash_order) {
    if (!popped_at.count(s)) {
      problems.push_back(layers[stashed_at[s]].where + " stashes skip " + s->describe() +
                         ", but no later layer pops it. Add stagewise::pops<...> with it to the "
                         "later layer that consumes the tensor, or remove the stash.");
    }
  }
  if (!problems.empty()) {
    std::ostringstream message;
    message << "stagewise::Pipe: the stashes and pops of its layers do not match ("
            << problems.size() << (problems.size() == 1 ? " problem" : " problems") << "):";
    for (const auto& p : problems) message << "\n* " << p;
    TORCH_CHECK(false, message.str());
  }
  std::vector<skip_route> routes;
  for (const auto* s : stash_order) {
    routes.push_back({{static_cast<int>(layers[stashed_at[s]].stage),
                       static_cast<int>(layers[popped_at[s]].stage)},
                      s});
  }
  return SkipLayout(num_stages, std::move(routes));
}

// The verified layout of a pipe over these stage modules (null for stages without one).
inline SkipLayout skip_layout_of(const std::vector<std::shared_ptr<torch::nn::Module>>& stages) {
  std::vector<LayerSkips> layers;
  for (std::size_t j = 0; j < stages.size(); ++j) {
    if (stages[j]) collect_layer_skips(*stages[j], j, "", layers);
  }
  return verify_skip_layers(layers, stages.size());
}

}  // namespace stagewise::detail
