#pragma once

// A GradientReducer's completed reduction (runtime/c10d/detail/reducer_state.hpp), checked and
// written into the gradients: every rank gave a parameter a gradient or none did, none got one
// after its bucket left; the unsharded averages into every gradient; the sharded owners' averages
// into their own (added to an average not stepped since); and the owners' parameters sent back.

#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/detail/reducer_bucket.hpp"
#include "stagewise/runtime/c10d/detail/shard_reduction.hpp"
#include "stagewise/runtime/c10d/reducer_options.hpp"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>

#include <cstddef>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

using InstalledGrad = std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>>;

// Whether `grad` is the very tensor a reduction wrote (`installed`, held weakly).
inline bool is_installed(const InstalledGrad& installed, const torch::Tensor& grad) {
  if (!installed || !grad.defined()) return false;
  const auto held = installed->lock();
  return held && held.get() == grad.unsafeGetTensorImpl();
}

// Every rank gave a parameter a gradient, or none did (unless unused_parameters); none got a
// second one after its bucket left.
inline void check_counts(const std::vector<ReducerParam>& params,
                         const std::vector<std::string>& late, int ranks,
                         const ReducerOptions& options, const float* u) {
  const float world = static_cast<float>(ranks);
  std::ostringstream partly;
  int n_partly = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (u[i] > 0 && u[i] < world) {
      partly << (n_partly++ ? ", " : "") << params[i].name << " (on " << u[i]
             << (u[i] == 1 ? " rank)" : " ranks)");
    }
  }
  TORCH_CHECK(n_partly == 0 || options.unused_parameters, options.who, ": ", n_partly,
              n_partly == 1 ? " parameter" : " parameters",
              " got a gradient on some ranks but not on others in this backward (of ", ranks,
              " ranks): ", partly.str(), ". Pass ", options.unused_fix,
              " to reduce them with zeros from the others (what one process on the whole batch "
              "computes), or use every "
              "parameter on every rank");
  if (!late.empty()) {
    std::ostringstream names;
    for (std::size_t i = 0; i < late.size(); ++i) names << (i ? ", " : "") << late[i];
    TORCH_CHECK(false, options.who, ": ", names.str(),
                " got another gradient in this backward after its bucket was reduced (a "
                "parameter reached twice, e.g. through two reentrant recomputes); its "
                "gradient would be wrong. Use it once per backward, or reduce it yourself");
  }
}

// Unsharded: the bucket's average into every gradient a rank used.
inline void write_all(ReducerBucket& b, std::vector<ReducerParam>& params, const float* u,
                      int ranks) {
  b.flat.div_(static_cast<float>(ranks));
  for (const auto i : b.members) {
    if (u[i] == 0) continue;  // no rank used it: its gradient stays as it is
    auto& p = params[i];
    auto slice = b.flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
    auto& grad = p.tensor.mutable_grad();
    if (grad.defined()) {
      grad.copy_(slice);
    } else {
      grad = slice.clone();
    }
  }
}

// Sharded: the owned parameters' gradients are this rank's averaged slice, each a tensor of
// its own over the slice's memory (not a view: optimizers detach_ gradients), which is freed
// once they all are; the others' are freed. An owned parameter no rank used keeps its own.
inline void write_owned(ReducerBucket& b, std::vector<ReducerParam>& params, const float* u,
                        int ranks, ReduceScatter how, int me, std::vector<torch::Tensor>& carried,
                        std::vector<InstalledGrad>& installed) {
  b.shard.retire(me, ranks, how);
  const auto& mine = b.shard.mine;
  for (const auto i : b.members) {
    auto& p = params[i];
    auto& grad = p.tensor.mutable_grad();
    if (p.owner != me) {
      grad.reset();
      continue;
    }
    // The last reduction's average, not stepped since: set aside when this rank's first
    // gradient arrived, or (no gradient here this time) still in place.
    auto before = std::move(carried[i]);
    carried[i] = torch::Tensor();
    if (!before.defined() && is_installed(installed[i], grad)) before = grad;
    if (u[i] == 0) {  // no rank used it: it keeps its gradient
      if (before.defined()) grad = before;
      continue;
    }
    const auto place = mine.narrow(0, p.shard_offset, p.tensor.numel()).view(p.tensor.sizes());
    if (before.defined()) {
      grad = before.add_(place);
    } else {
      grad = torch::empty({0}, mine.options());
      grad.set_(mine.storage(), place.storage_offset(), place.sizes(), place.strides());
    }
    installed[i] = c10::weak_intrusive_ptr<c10::TensorImpl>(grad.getIntrusivePtr());
  }
  b.shard.mine = torch::Tensor();
}

// Starts sending each owner's parameters of bucket `b` to every rank (owner by owner).
inline void gather_bucket(ParameterGather& gather, const Collectives& group, const ReducerBucket& b,
                          const std::vector<ReducerParam>& params) {
  for (int o = 0; o < group.size(); ++o) {
    std::vector<torch::Tensor> owned;
    for (const auto i : b.members) {
      if (params[i].owner == o) owned.push_back(params[i].tensor);
    }
    gather.launch(group, o, owned, b.shard.slice_of(o).numel);
  }
}

}  // namespace stagewise::runtime::detail
