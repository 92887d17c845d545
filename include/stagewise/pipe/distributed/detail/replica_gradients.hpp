#pragma once

// distributed::Pipe's data parallelism (`pipe_replicas`): the group of this rank's counterparts
// in every replica, a gradient reducer per local stage, and the loss averaged over the replicas'
// rows; with optimizer state sharded, each stage's parameters owned by its replicas in turn, and
// the owners' updates waited for before a stage's first forward. Default-constructed, it is one
// replica and does nothing.

#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/pipe/replicas.hpp"
#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/gather_text.hpp"
#include "stagewise/runtime/c10d/gradient_reducer.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/transport.hpp"
#include "stagewise/runtime/stage_runtime.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::distributed::detail {

class ReplicaGradients {
 public:
  /// One replica: nothing to average.
  ReplicaGradients() = default;

  /// `replicas` replicas, this rank in replica `replica`; `column`: the group of this rank's
  /// counterparts in every replica (its rank r is replica r). Copies replica 0's parameters and
  /// buffers of this rank's `stages` to every replica and makes a reducer per stage with
  /// gradients; `transport` (this replica's, kept alive by the pipe) waits for the collectives,
  /// failing as its receives do. `where` opens errors; `key` (the pipe's own) names the sharding
  /// check's exchange in the job's store.
  ReplicaGradients(runtime::Connection column, int replicas,
                   const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages,
                   runtime::C10dTransport* transport, const runtime::ReducerOptions& options,
                   torch::Device device, std::string where, const std::string& key,
                   std::chrono::milliseconds timeout)
      : column_(std::move(column)),
        replicas_(replicas),
        replica_(column_->env.rank),
        transport_(transport),
        device_(device),
        where_(std::move(where)),
        shard_(options.shard) {
    TORCH_CHECK(static_cast<bool>(column_->collectives), where_,
                ": the process group has no collectives");
    torch::NoGradGuard no_grad;
    reducers_.resize(stages.size());
    for (std::size_t j = 0; j < stages.size(); ++j) {
      if (!stages[j] || !stages[j]->spec.module) continue;
      auto& module = *stages[j]->spec.module;
      // Replica 0's parameters and buffers everywhere, so that the replicas start alike.
      std::vector<at::Tensor> all = module.parameters(/*recurse=*/true);
      for (const auto& b : module.buffers(/*recurse=*/true)) {
        if (b.defined()) all.push_back(b);
      }
      runtime::broadcast_each(column_->collectives, all, /*root=*/0);
      std::vector<torch::Tensor> params;
      std::vector<std::string> names;
      for (const auto& p : module.named_parameters(/*recurse=*/true)) {
        if (!p.value().requires_grad()) continue;
        params.push_back(p.value());
        names.push_back("stage" + std::to_string(j) + "." + p.key());
      }
      if (params.empty()) continue;
      reducers_[j] = std::make_unique<runtime::GradientReducer>(
          column_->collectives, std::move(params), std::move(names), options);
    }
    check_sharding(key, timeout);  // sharded or not: a rank that differs is named
  }

  bool many() const { return replicas_ > 1; }
  /// The first replica writes the stages' files of a save; every replica reads them.
  bool writes_stage_files() const { return replica_ == 0; }

  /// On stage j's worker, after its last backward: its gradients start travelling.
  void gradients_ready(int j) {
    if (auto& r = reducers_[static_cast<std::size_t>(j)]) r->launch();
  }

  /// The replicas' mean loss over their rows (checked equal), then the stages' averaged
  /// gradients.
  torch::Tensor finish(const torch::Tensor& loss, std::int64_t rows) {
    auto wait = [&](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
      transport_->wait_collective(w, column_->job_ranks, what);
    };
    const double r = static_cast<double>(rows);
    // On the transport's device: NCCL reduces only GPU tensors (Gloo takes either).
    auto sums =
        torch::tensor({loss.detach().to(torch::kCPU, torch::kDouble).item<double>() * r, r, r * r},
                      torch::kDouble)
            .to(device_);
    std::vector<at::Tensor> one{sums};
    wait(column_->collectives.all_reduce_sum(one), "the replicas' sum of the loss");
    sums = sums.to(torch::kCPU);
    const auto* s = sums.data_ptr<double>();
    // d * sum(r^2) == sum(r)^2 exactly when every replica had the same number of rows.
    TORCH_CHECK(static_cast<double>(replicas_) * s[2] == s[1] * s[1], where_, ": the ", replicas_,
                " replicas were given different numbers of rows (", s[1], " in all, this replica ",
                r,
                "), so averaging their gradients would weight rows unequally; give every replica "
                "the same number of rows (pipe->shard(global_batch))");
    for (std::size_t j = 0; j < reducers_.size(); ++j) {
      if (!reducers_[j]) continue;
      reducers_[j]->complete([&](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
        wait(w, what + " of stage " + std::to_string(j));
      });
    }
    return torch::full({}, s[0] / s[1], loss.options());
  }

  /// The reductions step `fused`'s parameters as their averages are written (null: not);
  /// sharded, the owned ones, each bucket's then sent to every replica (waited for before the
  /// next forward).
  void step_after_reduction(optim::FusedStep* fused) {
    if (fused != nullptr) own(*fused);
    for (auto& reducer : reducers_) {
      if (!reducer) continue;
      if (fused == nullptr) {
        reducer->set_after_reduce(nullptr);
        continue;
      }
      std::vector<std::size_t> slot;
      for (const auto& p : reducer->parameters()) {
        slot.push_back(fused->index_of(p, "distributed::Pipe::train_step"));
      }
      std::function<bool()> then_gather;
      if (reducer->sharded()) {
        then_gather = [fused] {
          return !::stagewise::detail::FusedStepAccess::in_norm_pass(*fused);
        };
      }
      reducer->set_after_reduce(
          [fused, slot = std::move(slot)](std::size_t i) { fused->step_parameter(slot[i]); },
          std::move(then_gather));
    }
  }

  /// Sharded: whether optimizer state is sharded over the replicas (the job's option: the same
  /// on every rank, also on one whose stages have no parameters).
  bool sharded() const { return many() && shard_; }

  /// Marks the parameters of `fused` this replica owns (sharded; else nothing): it keeps their
  /// optimizer state only, and a load refuses a save without it.
  void own(optim::FusedStep& fused) {
    if (!sharded()) return;
    const auto mine = owned_by_impl();
    std::vector<char> owned;
    for (const auto& p : fused.parameters()) {
      auto it = mine.find(p.unsafeGetTensorImpl());
      owned.push_back(it != mine.end() && it->second ? 1 : 0);
    }
    ::stagewise::detail::FusedStepAccess::set_shard(fused, std::move(owned));
  }

  /// Whether this replica owns `p` (a trainable parameter of its stages; sharded).
  bool owns(const torch::Tensor& p) const {
    const auto mine = owned_by_impl();
    auto it = mine.find(p.unsafeGetTensorImpl());
    return it != mine.end() && it->second;
  }

  /// Sharded: a sharded optimizer (`distributed::Sharded`) will send the owners' updates.
  void attach_sender() {
    for (auto& r : reducers_) {
      if (r && r->sharded()) r->attach_sender();
    }
  }

  /// Sharded: starts sending the owned parameters of every stage here to the other replicas.
  void send_updated() {
    for (auto& r : reducers_) {
      if (r && r->sharded()) r->gather_parameters();
    }
  }

  /// Gradients sharded every pass: around each action computing stage `j`'s weight gradients.
  void weight_pass(int j, bool begin) {
    auto& r = reducers_[static_cast<std::size_t>(j)];
    if (!r || !r->reduces_each_pass()) return;
    if (!begin) {
      r->end_pass();
      return;
    }
    r->begin_pass([&](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
      transport_->wait_collective(w, column_->job_ranks, what + " of stage " + std::to_string(j));
    });
  }

  /// Sharded: waits until stage `j`'s parameters (-1: every stage's) hold their owners' updates.
  void wait_parameters(int j) {
    for (std::size_t k = 0; k < reducers_.size(); ++k) {
      auto& r = reducers_[k];
      if (!r || !r->sharded() || (j >= 0 && static_cast<std::size_t>(j) != k)) continue;
      r->rehook();  // before the step's backward passes: a loaded parameter has a new node
      r->wait_parameters([&](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
        transport_->wait_collective(w, column_->job_ranks, what + " of stage " + std::to_string(k));
      });
    }
  }

  /// Bytes of gradients this rank all-reduced in the last step.
  std::int64_t bytes_last_step() const {
    std::int64_t bytes = 0;
    for (const auto& r : reducers_) {
      if (r) bytes += r->bytes_last_step();
    }
    return bytes;
  }

 private:
  // Each trainable parameter of the stages here (by TensorImpl): whether this replica owns it.
  std::map<const void*, bool> owned_by_impl() const {
    std::map<const void*, bool> out;
    for (const auto& r : reducers_) {
      if (!r) continue;
      const auto params = r->parameters();
      for (std::size_t i = 0; i < params.size(); ++i) {
        out[params[i].unsafeGetTensorImpl()] = r->owns(i);
      }
    }
    return out;
  }

  // Every replica of a stage shards it alike: each rank's stages' shardings against those of its
  // counterpart in replica 0 (every rank of the job takes part, through the job's store).
  void check_sharding(const std::string& key, std::chrono::milliseconds timeout) const {
    std::string mine;
    for (std::size_t j = 0; j < reducers_.size(); ++j) {
      if (reducers_[j])
        mine += "stage " + std::to_string(j) + ": " + reducers_[j]->sharding() + "; ";
    }
    const auto& c = *column_;
    const auto all = runtime::gather_text(c, key, mine, timeout,
                                          "the sharding check (every rank must build the pipe)");
    const int per_replica = c.job_world() / replicas_;
    const auto who = where_.substr(0, where_.rfind("::train_step"));  // a check at construction
    for (std::size_t r = 0; r < all.size(); ++r) {
      const auto first = static_cast<std::size_t>(static_cast<int>(r) % per_replica);
      TORCH_CHECK(all[r] == all[first], who, ": ranks ", first, " and ", r,
                  " shard the optimizer state of their stages differently: rank ", first, " {",
                  all[first], "}, rank ", r, " {", all[r],
                  "}; give every rank the same distributed::Options().shard_optimizer_state(...) "
                  "and reduce_scatter(...), and the same model (and stagewise build)");
    }
  }

  std::optional<runtime::Connection> column_;  // this rank's counterparts; none: one replica
  int replicas_ = 1;
  int replica_ = 0;
  runtime::C10dTransport* transport_ = nullptr;
  torch::Device device_ = torch::kCPU;
  std::string where_;
  bool shard_ = false;
  std::vector<std::unique_ptr<runtime::GradientReducer>> reducers_;  // per stage; null: none
};

static_assert(pipe_replicas<ReplicaGradients>);

}  // namespace stagewise::distributed::detail
