#pragma once

#include "stagewise/optim/detail/fused_slot.hpp"
#include "stagewise/optim/grad_scaler.hpp"
#include "stagewise/optim/parameter_state.hpp"
#include "stagewise/optim/savable_optimizer.hpp"
#include "stagewise/pipe/distributed/detail/sharded_state.hpp"

#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <cstddef>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise::distributed {

/// What a sharded optimizer (`Sharded`) steps: the parameters of a `DataParallel` module, or of
/// this rank's stages of a 2-D pipe, with optimizer state sharded over the replicas
/// (`shard_optimizer_state(true)`): which of them this replica owns, and how the replicas
/// exchange what a step needs. `dp.sharded_parameters()`, `pipe->sharded_parameters()`.
struct ShardedParameters {
  /// Opens errors ("stagewise::distributed::DataParallel").
  std::string who;
  /// Every parameter, in the module's (or the pipe's `parameters()`) order, and its name.
  std::vector<torch::Tensor> parameters;
  std::vector<std::string> names;
  /// 1 where this replica owns the parameter (it keeps its optimizer state and steps it).
  std::vector<char> owned;
  /// The number of replicas and this one's index.
  int replicas = 1;
  int replica = 0;
  /// Sends the owned parameters' new values to every replica (after the owners stepped them);
  /// every replica calls it at the same point.
  std::function<void()> send_updated;
  /// Tells the replicas a sharded optimizer will send the owners' updates after its steps
  /// (without one, a reduction is refused: no update would reach the others).
  std::function<void()> attach_sender;
  /// Every replica's (and, in a pipe, every rank's) sum of a one-element inf/NaN count.
  std::function<torch::Tensor(const torch::Tensor&)> sum_found_inf;
  /// Given this rank's gradient norms of `parameters` (`mine[i]`, undefined where it has no
  /// gradient or does not own it), every norm of the whole model in its order, every rank's
  /// alike; with the clip's max_norm and norm_type, which every rank must pass the same.
  std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& mine, double max_norm,
                                           double norm_type)>
      norms;
};

/// A LibTorch optimizer (`torch::optim::Adam`, `SGD`, ... as `Optimizer`) over the parameters
/// this replica owns when optimizer state is sharded over data-parallel replicas (ZeRO): it
/// holds state for its shard only, and its `step()` steps the shard and then sends the new values
/// from their owners to every replica (the others receive them before their next forward). So the
/// unsharded training loop is unchanged but for the optimizer's type:
///   sw::distributed::DataParallel dp(model, sw::distributed::DataParallelOptions()
///                                               .shard_optimizer_state(true));
///   sw::distributed::Sharded<torch::optim::Adam> adam(dp, torch::optim::AdamOptions(1e-3));
///   adam.zero_grad();
///   loss_fn(dp.forward(dp.shard(x)), dp.shard(y)).backward();  // owners get the averages
///   adam.step();                                               // this shard, then sent
/// It is an `Optimizer` (an `amp::GradScaler` steps it, summing its inf/NaN checks over every
/// replica first, so all skip or step alike); `clip_grad_norm_` clips by the whole model's norm;
/// `save` writes the unfused optimizer's archive over every parameter with state for the owned
/// ones (and their names), and `load` takes such an archive (or an unfused optimizer's, or one
/// naming another set of parameters) and keeps the owned parameters' state.
template <class Optimizer>
class Sharded : public Optimizer, public optim::JobWideChecks, public optim::ParameterStateLoad {
 public:
  /// Over `shards` (`dp.sharded_parameters()`, `pipe->sharded_parameters()`), with `options`
  /// (e.g. `torch::optim::AdamOptions(1e-3)`).
  template <class Options>
  Sharded(ShardedParameters shards, Options options)
      : Optimizer(owned_of(shards), options),
        shards_(std::move(shards)),
        make_([options](std::vector<torch::Tensor> params) {
          return std::unique_ptr<torch::optim::Optimizer>(
              std::make_unique<Optimizer>(std::move(params), options));
        }) {
    TORCH_CHECK(static_cast<bool>(shards_.send_updated), shards_.who,
                ": the optimizer state is not sharded; build it with shard_optimizer_state(true), "
                "or use the unsharded optimizer");
    if (shards_.attach_sender) shards_.attach_sender();
  }
  /// Over a `DataParallel`'s or a 2-D pipe's shard (anything with `sharded_parameters()`).
  template <class Source, class Options>
  requires requires(Source& s) { s.sharded_parameters(); }
  Sharded(Source& source, Options options) : Sharded(source.sharded_parameters(), options) {}
  /// Over a pipe holder (`distributed::Pipe`): `pipe->sharded_parameters()`.
  template <class Source, class Options>
  requires requires(Source& s) { s->sharded_parameters(); }
  Sharded(Source& source, Options options) : Sharded(source->sharded_parameters(), options) {}

  /// Steps the owned parameters (those with a gradient), then sends their new values to every
  /// replica. Every replica calls it at the same point.
  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    auto loss = Optimizer::step(std::move(closure));
    shards_.send_updated();
    return loss;
  }

  /// Clips the owned gradients by the norm of the whole model's gradients, every shard (and, in
  /// a pipe, every stage) counted once, as `torch::nn::utils::clip_grad_norm_` over the whole
  /// model's parameters in one process does; returns that norm. Every replica calls it.
  ///   adam.clip_grad_norm_(1.0);
  double clip_grad_norm_(double max_norm, double norm_type = 2.0) {
    std::vector<torch::Tensor> mine(shards_.parameters.size());
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto& g = shards_.parameters[i].grad();
      if (shards_.owned[i] && g.defined()) {
        mine[i] = ::stagewise::detail::grad_norm_part(g, norm_type);
      }
    }
    auto norms = shards_.norms(mine, max_norm, norm_type);
    if (norms.empty()) return 0.0;
    torch::Tensor total;
    if (norm_type == std::numeric_limits<double>::infinity()) {
      total = norms.size() == 1 ? norms[0] : torch::max(torch::stack(norms));
    } else if (norm_type == 0) {
      total = torch::full({}, static_cast<double>(norms.size()));
    } else {
      total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(norm_type);
    }
    const auto coef = torch::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      if (mine[i].defined()) shards_.parameters[i].mutable_grad().mul_(coef);
    }
    return total.item<double>();
  }

  /// The unfused optimizer's archive over every parameter (`shards().parameters`), with state for
  /// the owned ones and every parameter's name: an unsharded optimizer over the same parameters
  /// loads it (getting this shard's state), and so does `load`.
  void save(torch::serialize::OutputArchive& archive) const override {
    detail::save_shard(*this, make_, shards_.parameters, shards_.names, archive);
  }
  /// Loads an archive of `save`, or of an unfused optimizer over the same parameters: keeps the
  /// owned parameters' state. With names (a `save`) it matches parameters by name, so an archive
  /// over more or fewer parameters loads too. Refuses, naming them and changing nothing, owned
  /// parameters without state in an archive that holds state for others.
  void load(torch::serialize::InputArchive& archive) override {
    auto loaded = detail::load_shard(archive, make_, shards_.parameters, shards_.names,
                                     shards_.owned, shards_.who + " (Sharded::load)");
    this->state().clear();
    for (auto& [i, state] : loaded.state) {
      this->state()[detail::optimizer_state_key(shards_.parameters[i])] = std::move(state);
    }
    this->param_groups()[0].set_options(loaded.whole->param_groups()[0].options().clone());
  }

  /// Its state one parameter at a time, as a pipe's save keeps it under the model's names
  /// (`parameter_state_optimizer`): the kind is the unsharded optimizer's, and this replica keeps,
  /// writes and reads the state of the parameters it owns; a save loads at any replica count,
  /// sharded or not.
  std::string state_kind() const { return optim::state_kind(base()); }
  bool keeps_state(const torch::Tensor& param) const { return optim::keeps_state(base(), param); }
  bool save_state(const torch::Tensor& param, torch::serialize::OutputArchive& archive) const {
    return optim::save_state(base(), param, archive);
  }
  void load_state(const torch::Tensor& param, torch::serialize::InputArchive& archive) override {
    // The optimizer's own load, not Sharded's (which takes whole archives of `save`).
    optim::load_state_with(*this, param, archive,
                           [&](torch::serialize::InputArchive& a) { Optimizer::load(a); });
  }

  /// A GradScaler's inf/NaN check, summed over every replica (`optim::JobWideChecks`).
  torch::Tensor sum_found_inf(const torch::Tensor& found) override {
    return shards_.sum_found_inf(found);
  }

  /// What this optimizer steps: every parameter, which are owned here, and the replicas.
  const ShardedParameters& shards() const { return shards_; }

 private:
  const torch::optim::Optimizer& base() const { return *this; }

  static std::vector<torch::Tensor> owned_of(const ShardedParameters& s) {
    TORCH_CHECK(s.parameters.size() == s.owned.size() && s.names.size() == s.owned.size(), s.who,
                ": the sharded parameters are inconsistent");
    std::vector<torch::Tensor> out;
    for (std::size_t i = 0; i < s.parameters.size(); ++i) {
      if (s.owned[i]) out.push_back(s.parameters[i]);
    }
    return out;
  }

  ShardedParameters shards_;
  detail::OptimizerOver make_;
};

static_assert(parameter_state_optimizer<Sharded<torch::optim::Adam>>);
static_assert(savable_optimizer<Sharded<torch::optim::Adam>>);

}  // namespace stagewise::distributed
