#pragma once

#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/pipe/detail/clip_norms.hpp"
#include "stagewise/pipe/distributed/sharded.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/gradient_reducer.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/startup.hpp"
#include "stagewise/runtime/stage_signature.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise::distributed {

/// Options of `DataParallel`.
///   stagewise::distributed::DataParallelOptions().bucket_bytes(4 << 20).unused_parameters(true)
struct DataParallelOptions {
  /// Bytes of gradients per bucket, one all-reduce each (default 25 MiB, as PyTorch's DDP):
  /// smaller buckets start reducing earlier in backward, larger ones cost fewer messages.
  DataParallelOptions& bucket_bytes(std::int64_t b) {
    reducer_.bucket_bytes = b;
    return *this;
  }
  /// Lets a parameter get a gradient on some ranks and not others in a step (a branch or expert
  /// some ranks' rows did not reach): those ranks add zeros, which is what one process on the
  /// whole batch computes. Off by default: such a step is then an error on every rank naming the
  /// parameters. A parameter no rank used keeps its gradient (none) either way.
  DataParallelOptions& unused_parameters(bool on) {
    reducer_.unused_parameters = on;
    return *this;
  }
  /// How long start-up waits for the other ranks (default 30 s).
  DataParallelOptions& timeout(std::chrono::milliseconds t) {
    connect_.timeout = t;
    return *this;
  }
  /// The backend `connect` builds when DataParallel rendezvouses itself (Gloo by default; NCCL
  /// for CUDA parameters).
  DataParallelOptions& backend(runtime::Backend b) {
    connect_.backend = b;
    return *this;
  }
  /// Shards the optimizer state and the gradients over the ranks (ZeRO-2): each parameter is
  /// owned by one rank (whole tensors balanced by size, `optim::shard_owners`); a backward brings
  /// each bucket's averaged gradients to their owners only and frees every other copy at once;
  /// the optimizer (`distributed::Sharded<torch::optim::Adam>`, or a fused step given to
  /// `step_with`) keeps state for the owned parameters only and steps them, and their new values
  /// are then sent from the owners to every rank. Off by default. See docs/distributed.md,
  /// "Sharded state".
  ///   sw::distributed::DataParallelOptions().shard_optimizer_state(true)
  DataParallelOptions& shard_optimizer_state(bool on) {
    reducer_.shard = on;
    return *this;
  }
  /// How sharded gradients reach their owners (default `runtime::ReduceScatter::reduce`; see
  /// there for what each costs).
  DataParallelOptions& reduce_scatter(runtime::ReduceScatter how) {
    reducer_.reduce_scatter = how;
    return *this;
  }

  std::int64_t bucket_bytes() const { return reducer_.bucket_bytes; }
  bool unused_parameters() const { return reducer_.unused_parameters; }
  bool shard_optimizer_state() const { return reducer_.shard; }
  runtime::ReduceScatter reduce_scatter() const { return reducer_.reduce_scatter; }
  const runtime::ConnectOptions& connect() const { return connect_; }
  const runtime::ReducerOptions& reducer() const { return reducer_; }

 private:
  runtime::ReducerOptions reducer_{.who = "stagewise::distributed::DataParallel"};
  runtime::ConnectOptions connect_;
};

/// Data-parallel training of any LibTorch module over c10d, as PyTorch's
/// DistributedDataParallel does in Python: every rank holds the whole model and trains on its own
/// rows of each global batch; backward averages the gradients over the ranks, so every rank's
/// optimizer then takes the same step. At construction every rank checks that all built the same
/// model, and rank 0's parameters and buffers are copied to every rank. During backward, the
/// gradients are reduced in buckets (`DataParallelOptions::bucket_bytes`), each launched as soon
/// as its gradients are final, so communication overlaps the rest of backward; backward returns
/// with every gradient averaged.
///   // every rank, started by tools/launch -n 4 (or torchrun):
///   stagewise::distributed::DataParallel dp(model);
///   torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
///   auto loss = loss_fn(dp.forward(dp.shard(x)), dp.shard(y));  // this rank's rows
///   adam.zero_grad(); loss.backward(); adam.step();
/// Call `dp.forward` (not the module's own forward): the reduction starts from its outputs. A
/// backward that reaches the parameters without passing through `dp.forward`'s outputs is an
/// error, unless it runs under `no_sync()`.
template <class ModuleHolder>
class DataParallel {
 public:
  /// Rendezvouses from the environment (torchrun's variables) and wraps `module`.
  explicit DataParallel(ModuleHolder module, DataParallelOptions options = {})
      : DataParallel(runtime::connect(runtime::rendezvous_env(), options.connect()),
                     std::move(module), options) {}

  /// Wraps `module` over a job the caller already joined (`runtime::connect`).
  DataParallel(runtime::Connection connection, ModuleHolder module,
               DataParallelOptions options = {})
      : connection_(std::move(connection)), module_(std::move(module)) {
    const auto& who = options.reducer().who;
    const auto key = "stagewise/data_parallel/" + std::to_string(instance()++);
    runtime::check_same_model(connection_, {runtime::stage_signature(*module_)}, key,
                              options.connect().timeout);
    broadcast_from_rank0(who);
    std::vector<torch::Tensor> params;
    std::vector<std::string> names;
    for (const auto& p : module_->named_parameters(/*recurse=*/true)) {
      if (!p.value().requires_grad()) continue;
      params.push_back(p.value());
      names.push_back(p.key());
    }
    reducer_ = std::make_unique<runtime::GradientReducer>(
        connection_.collectives, std::move(params), std::move(names), options.reducer());
    runtime::check_same_sharding(connection_, reducer_->sharding(), key + "/shard",
                                 options.connect().timeout, who,
                                 "DataParallelOptions().shard_optimizer_state(...) and "
                                 "reduce_scatter(...)");
  }

  /// Runs the module's forward and marks its output tensors, so that their backward averages the
  /// gradients over the ranks. The module may return a tensor, a vector or a tuple of them.
  template <class... Args>
  auto forward(Args&&... args) {
    auto out = module_->forward(std::forward<Args>(args)...);
    return mark_all(std::move(out));
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// Steps `fused`'s parameters from backward, each on its averaged gradient as soon as its
  /// bucket's average is written at the end of backward, and frees that gradient: a reducing
  /// `loss.backward()` then leaves the model stepped (no `optimizer.step()`), bucket by bucket.
  /// Detaches `fused`'s own hooks, which would step on this rank's gradients before they are
  /// averaged; every trainable parameter of the module must be one of `fused`'s. Backward passes
  /// under `no_sync()` only accumulate, as without it. `fused` must outlive this DataParallel.
  ///   sw::optim::FusedStep fused(model->parameters(), torch::optim::AdamOptions(1e-3));
  ///   dp.step_with(fused);
  ///   loss_fn(dp.forward(x), y).backward();  // averaged, stepped, gradients freed
  ///
  /// With `shard_optimizer_state(true)` each rank steps only the parameters it owns (and keeps
  /// `fused`'s state for those alone: its save holds them, its load keeps them), sending each
  /// bucket's new values to every rank as soon as they are stepped; backward returns once every
  /// rank has them. `optim::clip_grad_norm_step(fused, closure, max_norm)` and a GradScaler's
  /// `step(fused, closure)` then total their norms and inf/NaN checks over every rank.
  void step_with(optim::FusedStep& fused) {
    std::vector<std::size_t> slot;
    for (const auto& p : module_->named_parameters(/*recurse=*/true)) {
      if (!p.value().requires_grad()) continue;
      slot.push_back(fused.index_of(p.value(), "DataParallel::step_with"));
    }
    fused.detach();
    ::stagewise::detail::FusedStepAccess::set_driven(fused, true);  // clips and scalers run
    auto step = [&fused, slot](std::size_t i) { fused.step_parameter(slot[i]); };
    if (!reducer_->sharded()) {
      reducer_->set_after_reduce(std::move(step));
      return;
    }
    std::vector<char> owned(fused.size(), 0);
    for (std::size_t k = 0; k < slot.size(); ++k) owned[slot[k]] = reducer_->owns(k) ? 1 : 0;
    const auto norms = norm_gather(fused.parameters());
    ::stagewise::detail::FusedStepAccess::set_shard(
        fused, std::move(owned),
        [norms, &fused](const std::vector<torch::Tensor>& mine) {
          return norms(mine, 0.0,
                       ::stagewise::detail::FusedStepAccess::state(fused).shared.norm_type);
        },
        found_inf_sum());
    // Stepped buckets go to every rank at once (not after a clip's norm pass, which steps
    // nothing); backward returns once all have arrived.
    reducer_->set_after_reduce(
        std::move(step),
        [&fused] { return !::stagewise::detail::FusedStepAccess::in_norm_pass(fused); },
        /*wait=*/true);
  }

  /// With `shard_optimizer_state(true)`: what a sharded optimizer steps (`Sharded<Optimizer>`
  /// takes it): the module's parameters, which this rank owns, and how the ranks exchange
  /// updated parameters, inf/NaN checks and gradient norms.
  ///   sw::distributed::Sharded<torch::optim::SGD> sgd(dp, torch::optim::SGDOptions(0.1));
  ShardedParameters sharded_parameters() {
    ShardedParameters s;
    s.who = "stagewise::distributed::DataParallel";
    TORCH_CHECK(reducer_->sharded(), s.who,
                ": the optimizer state is not sharded; build DataParallel with "
                "DataParallelOptions().shard_optimizer_state(true), or use an unsharded optimizer");
    s.replicas = world_size();
    s.replica = rank();
    std::size_t k = 0;  // index among the trainable parameters (the reducer's)
    for (const auto& p : module_->named_parameters(/*recurse=*/true)) {
      s.parameters.push_back(p.value());
      s.names.push_back(p.key());
      s.owned.push_back(p.value().requires_grad() && reducer_->owns(k) ? 1 : 0);
      if (p.value().requires_grad()) ++k;
    }
    s.attach_sender = [this] { reducer_->attach_sender(); };
    s.send_updated = [this] {
      reducer_->gather_parameters();
      reducer_->wait_parameters();  // every rank has them when the step returns
    };
    s.sum_found_inf = found_inf_sum();
    s.norms = norm_gather(s.parameters);
    return s;
  }

  /// With `shard_optimizer_state(true)`: the trainable parameters this rank owns (keeps optimizer
  /// state for and steps); all of them without.
  std::vector<torch::Tensor> owned_parameters() const {
    std::vector<torch::Tensor> out;
    const auto params = reducer_->parameters();
    for (std::size_t k = 0; k < params.size(); ++k) {
      if (reducer_->owns(k)) out.push_back(params[k]);
    }
    return out;
  }

  /// Marks one tensor computed from the module (for outputs `forward` cannot see into).
  torch::Tensor mark(const torch::Tensor& t) const { return reducer_->mark(t); }

  /// While alive, backward passes only accumulate gradients on each rank (no communication):
  /// for gradient accumulation, run the first micro-steps' forward and backward under it and the
  /// last one outside, whose backward averages everything accumulated.
  ///   { auto local = dp.no_sync(); loss_fn(dp.forward(x1), y1).backward(); }
  ///   loss_fn(dp.forward(x2), y2).backward();  // averages both micro-steps' gradients
  class NoSync {
   public:
    explicit NoSync(runtime::GradientReducer& r) : reducer_(&r), was_(r.enabled()) {
      r.set_enabled(false);
    }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    ~NoSync() { reducer_->set_enabled(was_); }

   private:
    runtime::GradientReducer* reducer_;
    bool was_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*reducer_); }

  /// This rank's rows of a global batch: the r-th of `world_size()` equal slices along dim 0.
  /// The rows must split evenly (the average of the ranks' mean gradients is then the whole
  /// batch's mean gradient); anything else is an error naming the fix.
  torch::Tensor shard(const torch::Tensor& global) const {
    const auto rows = global.size(0);
    const int w = world_size();
    TORCH_CHECK(rows % w == 0, "stagewise::distributed::DataParallel::shard: the batch has ", rows,
                " rows, which do not split evenly over ", w,
                " ranks (unequal shares would weight rows unequally); give a multiple of ", w,
                " rows");
    return global.narrow(0, rank() * (rows / w), rows / w);
  }

  ModuleHolder& module() { return module_; }
  const ModuleHolder& module() const { return module_; }
  int rank() const { return connection_.env.rank; }
  int world_size() const { return connection_.env.world_size; }
  /// The buckets: indices into the module's trainable parameters, in reduction order.
  std::vector<std::vector<std::size_t>> buckets() const { return reducer_->buckets(); }
  /// Bytes of gradients this rank all-reduced in the last backward.
  std::int64_t bytes_reduced_last_step() const { return reducer_->bytes_last_step(); }

 private:
  static int& instance() {
    static int n = 0;
    return n;
  }

  void broadcast_from_rank0(const std::string& who) {
    TORCH_CHECK(static_cast<bool>(connection_.collectives), who,
                ": the connection has no collectives; build it with runtime::connect, or set "
                "Connection::collectives to runtime::Collectives(your_process_group)");
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> all;
    for (const auto& p : module_->parameters(/*recurse=*/true)) all.push_back(p);
    for (const auto& b : module_->buffers(/*recurse=*/true)) {
      if (b.defined()) all.push_back(b);
    }
    runtime::broadcast_each(connection_.collectives, all, /*root=*/0);
  }

  // Every rank's sum of a one-element inf/NaN count (one all-reduce).
  std::function<torch::Tensor(const torch::Tensor&)> found_inf_sum() {
    return [this](const torch::Tensor& found) {
      std::vector<at::Tensor> one{found.to(device(), torch::kFloat, false, /*copy=*/true)};
      connection_.collectives.all_reduce_sum(one)->wait();
      return one.front();
    };
  }

  // Every rank's gradient norms of `params` (this rank's: `mine`), merged in their order: each
  // parameter's norm from the one rank that has it (its owner).
  std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&, double, double)>
  norm_gather(std::vector<torch::Tensor> params) {
    return [this, params = std::move(params)](const std::vector<torch::Tensor>& mine,
                                              double max_norm, double norm_type) {
      const runtime::Processes here{rank(), world_size(), {}};
      const auto values = ::stagewise::detail::norm_values(here, {module_->parameters()}, params,
                                                           mine, max_norm, norm_type);
      const auto all = runtime::all_gather_values(
          connection_.collectives, values, device(),
          [](const c10::intrusive_ptr<c10d::Work>& w) { w->wait(); }, norm_room_);
      return ::stagewise::detail::stage_norms(all, 1, max_norm, norm_type,
                                              "stagewise::distributed::DataParallel");
    };
  }

  // Where the ranks' collectives run: the parameters' device (NCCL reduces GPU tensors only).
  torch::Device device() const {
    const auto params = reducer_->parameters();
    return params.empty() ? torch::Device(torch::kCPU) : params.front().device();
  }

  torch::Tensor mark_all(torch::Tensor t) { return reducer_->mark(t); }
  std::vector<torch::Tensor> mark_all(std::vector<torch::Tensor> ts) {
    for (auto& t : ts) t = reducer_->mark(t);
    return ts;
  }
  template <class... T>
  std::tuple<T...> mark_all(std::tuple<T...> ts) {
    std::apply([&](auto&... t) { (mark_one(t), ...); }, ts);
    return ts;
  }
  template <class T>
  void mark_one(T& t) {
    if constexpr (std::is_same_v<std::remove_cvref_t<T>, torch::Tensor>) t = reducer_->mark(t);
  }

  runtime::Connection connection_;
  ModuleHolder module_;
  std::unique_ptr<runtime::GradientReducer> reducer_;
  std::int64_t norm_room_ = 0;  // numbers per rank of the norm gathers (all_gather_values)
};

}  // namespace stagewise::distributed
