#pragma once

// Averages gradients over a group of ranks in buckets launched during backward, as soon as each
// bucket's gradients are final, so that communication overlaps the rest of backward. The engine
// under distributed::DataParallel (any module) and under the data-parallel replicas of a pipe;
// sharded (ZeRO), it leaves each average on its parameter's owner only and sends the owners'
// updated parameters back.

#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/detail/reducer_state.hpp"
#include "stagewise/runtime/c10d/reducer_options.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime {

class GradientReducer {
 public:
  /// Hooks `params` (names for errors, or empty) for reduction over `group`. Every rank builds it
  /// over the same parameters in the same order: buckets (of one dtype and device each) follow
  /// the reverse order of `params`, where backward usually finishes them.
  GradientReducer(Collectives group, std::vector<torch::Tensor> params,
                  std::vector<std::string> names, ReducerOptions options)
      : state_(std::make_shared<detail::ReducerState>()) {
    auto& s = *state_;
    TORCH_CHECK(static_cast<bool>(group), options.who,
                ": the connection has no collectives; build it with runtime::connect, or set "
                "Connection::collectives to runtime::Collectives(your_process_group)");
    TORCH_CHECK(options.bucket_bytes > 0, options.who, ": bucket_bytes is ", options.bucket_bytes,
                "; give a positive size");
    s.group = std::move(group);
    s.options = std::move(options);
    for (std::size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(params[i].requires_grad(), s.options.who, ": ", name_of(names, i),
                  " does not require grad; pass only parameters that get gradients");
      detail::ReducerParam p;
      p.tensor = params[i];
      p.name = name_of(names, i);
      s.params.push_back(std::move(p));
    }
    s.plan_buckets();
    TORCH_CHECK(!s.options.reduce_each_pass || (s.options.shard && !s.options.from_backward),
                s.options.who, ": reduce_each_pass is for a sharded reducer driven by launch()");
    if (s.options.from_backward || s.options.reduce_each_pass || s.options.shard) s.hook_all();
    std::lock_guard<std::mutex> lock(registry_mutex());
    id_ = next_id()++;
    registry()[id_] = state_;
  }

  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;
  ~GradientReducer() {
    {
      std::lock_guard<std::mutex> lock(registry_mutex());
      registry().erase(id_);
    }
    state_->unhook_all();
  }

  /// Returns `x` unchanged, but marks the start of its backward: the backward that reaches it
  /// reduces the gradients of this reducer's parameters when it ends. Mark a module's outputs
  /// (DataParallel's forward does).
  torch::Tensor mark(const torch::Tensor& x) const {
    TORCH_CHECK(state_->options.from_backward, state_->options.who,
                ": this reducer is driven by launch() and complete(), not by backward; build it "
                "with ReducerOptions::from_backward true to mark outputs");
    if (!x.defined() || !x.requires_grad() || !torch::GradMode::is_enabled()) return x;
    return BackwardStart::apply(x, static_cast<std::int64_t>(id_));
  }

  /// Starts averaging the gradients as they are now (`ReducerOptions::from_backward` false):
  /// every bucket's all-reduce, in bucket order, and the count of ranks that gave each parameter
  /// a gradient, all asynchronously. A parameter without a gradient adds zeros. Every rank of
  /// the group calls it, in the same order as its other collectives on the group; `complete()`
  /// then waits and writes the averages.
  void launch() {
    auto& s = *state_;
    std::lock_guard<std::mutex> lock(s.mutex);
    TORCH_CHECK(!s.options.from_backward, s.options.who,
                ": launch() is for a reducer built with ReducerOptions::from_backward false");
    TORCH_CHECK(!s.launched_by_hand, s.options.who,
                ": launch() was called twice without complete() between");
    if (s.options.reduce_each_pass) {
      // The passes reduced the gradients already: only the count of ranks that used each one.
      TORCH_CHECK(s.in_step, s.options.who, ": launch() before any begin_pass()");
      s.ready = s.used_any;
      s.in_step = false;
    } else {
      s.start_round();
      for (std::size_t i = 0; i < s.params.size(); ++i) {
        // A gradient that is still the last reduction's average got nothing new here.
        const auto& grad = s.params[i].tensor.grad();
        s.ready[i] = grad.defined() && !s.installed_is(i, grad) ? 1 : 0;
      }
      for (auto& b : s.buckets) b.pending = 0;
      s.launch_ready();
    }
    s.launch_counts();
    s.launched_by_hand = true;
  }

  /// With `ReducerOptions::reduce_each_pass`: before and after each backward pass of a step (a
  /// micro-batch's backward of this reducer's parameters), on the thread that runs it. Between
  /// them the parameters' gradients leave bucket by bucket as they arrive; `begin_pass` first
  /// waits (through `wait`, if given) for the previous pass's. Every rank of the group runs the
  /// same passes in the same order.
  void begin_pass(const detail::AwaitWork& wait = {}) {
    state_->begin_pass(
        wait ? wait
             : [](const c10::intrusive_ptr<c10d::Work>& w, const std::string&) { w->wait(); });
  }
  void end_pass() { state_->end_pass(); }
  /// Hooks again the parameters whose gradient accumulators changed (a parameter given other
  /// storage in place, as torch::load does): before a step's backward passes, for a reducer
  /// driven by launch() (a marked backward does it itself).
  void rehook() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->hook_all();
  }
  /// Whether backward passes are reduced one by one (`ReducerOptions::reduce_each_pass`).
  bool reduces_each_pass() const { return state_->options.reduce_each_pass; }

  /// Waits for what `launch()` started (each through `wait(work, what)` if given, e.g. to fail
  /// as the job's other communication does; else work->wait()), checks that every rank gave a
  /// parameter a gradient or none did (see ReducerOptions::unused_parameters), and writes the
  /// averages into the gradients, calling `set_after_reduce`'s function bucket by bucket.
  void complete(const detail::AwaitWork& wait = {}) {
    auto& s = *state_;
    std::lock_guard<std::mutex> lock(s.mutex);
    TORCH_CHECK(s.launched_by_hand, s.options.who, ": complete() without launch() before it");
    s.launched_by_hand = false;
    s.complete_locked(wait);
  }

  /// Off: backward passes accumulate gradients locally, unreduced (gradient accumulation); the
  /// next backward of a marked output, with it on, reduces what accumulated.
  void set_enabled(bool on) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->enabled = on;
  }
  bool enabled() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->enabled;
  }

  /// Called, at the end of each reducing backward, for every parameter whose averaged gradient
  /// was written, bucket after bucket as each is written (e.g. to step it: a fused optimizer);
  /// sharded, for the parameters this rank owns. Sharded, `then_gather` (if given) is asked after
  /// each bucket's calls whether to send the bucket's owned parameters to every rank at once
  /// (the fused step stepped them; a norm pass did not), and with `wait` the reduction returns
  /// only once every rank has them. Between backward passes only.
  void set_after_reduce(std::function<void(std::size_t)> after,
                        std::function<bool()> then_gather = {}, bool wait = false) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->after_reduce = std::move(after);
    state_->gather_after_reduce = std::move(then_gather);
    state_->wait_gathers = wait;
  }

  /// Sharded (`ReducerOptions::shard`): whether parameter `i` (of `params`) is this rank's, and
  /// every parameter's owner (a rank of the group).
  bool sharded() const { return state_->options.shard; }
  bool owns(std::size_t i) const { return !sharded() || owner_of(i) == state_->group.rank(); }
  int owner_of(std::size_t i) const {
    TORCH_CHECK(sharded(), state_->options.who, ": the parameters are not sharded");
    return state_->params.at(i).owner;
  }

  /// Sharded: an optimizer that sends the owners' updates after its step is attached
  /// (`distributed::Sharded` does this); a reduction with neither it nor `set_after_reduce`
  /// (a fused step) is an error naming the fix, for no update would reach the other ranks.
  void attach_sender() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->sender_attached = true;
  }

  /// Sharded: starts sending every owner's parameters to every rank (after the owners stepped
  /// them), bucket by bucket and owner by owner; every rank calls it at the same point. The
  /// parameters must not be read before `wait_parameters` returns.
  void gather_parameters() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TORCH_CHECK(sharded(), state_->options.who,
                ": gather_parameters() is for sharded parameters (ReducerOptions::shard)");
    for (const auto& b : state_->buckets) {
      detail::gather_bucket(state_->gather, state_->group, b, state_->params);
    }
  }
  /// Waits for what `gather_parameters` (or a fused step's gathering) sent, through `wait` if
  /// given (else work->wait()), and writes the received values into the parameters.
  void wait_parameters(const detail::AwaitWork& wait = {}) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->gather.wait(
        wait ? wait
             : [](const c10::intrusive_ptr<c10d::Work>& w, const std::string&) { w->wait(); });
  }
  /// How the parameters are sharded, as ranks compare it (`check_same_sharding`): "not sharded",
  /// or the group's size, the reduce-scatter and every parameter's owner.
  std::string sharding() const {
    const auto& s = *state_;
    if (!s.options.shard) return "not sharded";
    static const char* how[] = {"reduce", "all_to_all", "all_reduce"};
    std::string out = "sharded over " + std::to_string(s.group.size()) + " ranks, reduce_scatter " +
                      how[static_cast<int>(s.options.reduce_scatter)] +
                      (s.options.reduce_each_pass ? ", every pass" : "") + ", owners";
    for (const auto& p : s.params) out += " " + std::to_string(p.owner);
    return out;
  }

  /// Whether updated parameters are on their way (sent, not yet waited for).
  bool parameters_pending() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->gather.pending();
  }

  /// The parameters, in the order given.
  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> out;
    for (const auto& p : state_->params) out.push_back(p.tensor);
    return out;
  }

  /// Number of buckets and the parameters (indices into `params`) of each.
  std::vector<std::vector<std::size_t>> buckets() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : state_->buckets) out.push_back(b.members);
    return out;
  }
  /// Bytes of gradients this rank all-reduced in the last marked backward.
  std::int64_t bytes_last_step() const { return state_->bytes; }

 private:
  // The node at the start of a marked backward: tells its reducer that backward began.
  struct BackwardStart : torch::autograd::Function<BackwardStart> {
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                                 std::int64_t id) {
      ctx->saved_data["id"] = id;
      return x.view_as(x);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      std::shared_ptr<detail::ReducerState> state;
      {
        std::lock_guard<std::mutex> lock(registry_mutex());
        auto it = registry().find(static_cast<std::uint64_t>(ctx->saved_data["id"].toInt()));
        if (it != registry().end()) state = it->second.lock();
      }
      if (state) state->begin_backward();
      return {grads[0], torch::Tensor()};
    }
  };

  static std::string name_of(const std::vector<std::string>& names, std::size_t i) {
    return i < names.size() ? "parameter '" + names[i] + "'" : "parameter " + std::to_string(i);
  }
  static std::mutex& registry_mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<std::uint64_t, std::weak_ptr<detail::ReducerState>>& registry() {
    static std::map<std::uint64_t, std::weak_ptr<detail::ReducerState>> r;
    return r;
  }
  static std::uint64_t& next_id() {
    static std::uint64_t id = 1;
    return id;
  }

  std::shared_ptr<detail::ReducerState> state_;
  std::uint64_t id_ = 0;
};

}  // namespace stagewise::runtime
