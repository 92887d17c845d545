#pragma once

#include "stagewise/optim/state_offload.hpp"
#include "stagewise/runtime/state_store.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <concepts>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// Which cell's tensors a store holds: micro-batch `micro` of stage `stage`.
struct StoreKey {
  int stage = 0;
  int micro = 0;
  friend bool operator==(const StoreKey&, const StoreKey&) = default;
};

/// A host store for offloaded activations (what a checkpointed cell keeps between its forward and
/// its recompute): `begin_step(stages)` before a step that offloads on those stages (open files,
/// fail early with a text naming the store and the fix); `put(key, tensors)` at an offload O,
/// taking the device tensors (some may be undefined) and freeing their device memory only once
/// its copy has landed; `take(key, device)` at a reload L, giving them back on `device`, ready for
/// the work the caller queues next on its current stream; `describe()` names the store in errors
/// ("FileStore('/nvme/offload')"). Models: `FileStore`, `HostStore`; a new one needs only this.
///   static_assert(stagewise::runtime::offload_store<MyStore>);
template <class S>
concept offload_store = requires(S& s, const std::vector<int>& stages, const StoreKey& key,
                                 std::vector<torch::Tensor> tensors, const torch::Device& device) {
  s.begin_step(stages);
  s.put(key, std::move(tensors));
  { s.take(key, device) } -> std::same_as<std::vector<torch::Tensor>>;
  { s.describe() } -> std::convertible_to<std::string>;
};

/// Any `offload_store` (a store of activations) or `state_store` (of optimizer state), or one
/// that is both (`HostStore`, `FileStore`: one store may hold a pipe's activations and its
/// optimizer's state), shared: copies of an AnyStore (e.g. of the PipeOptions holding it) are
/// one store, so its buffers and files live across steps. `keeps_activations()` and
/// `keeps_state()` say which it is; a call the store cannot serve is an error naming the fix.
///   stagewise::runtime::AnyStore store(stagewise::runtime::FileStore("/nvme/offload"));
class AnyStore {
 public:
  template <class S>
  requires(!std::same_as<std::decay_t<S>, AnyStore> && (offload_store<S> || state_store<S>))
      AnyStore(S store)  // NOLINT: implicit, as any store converts
      : self_(std::make_shared<Model<S>>(std::move(store))) {}

  void begin_step(const std::vector<int>& stages) { self_->begin_step(stages); }
  void put(const StoreKey& key, std::vector<torch::Tensor> tensors) {
    self_->put(key, std::move(tensors));
  }
  std::vector<torch::Tensor> take(const StoreKey& key, const torch::Device& device) {
    return self_->take(key, device);
  }
  std::string describe() const { return self_->describe(); }
  /// Tells the store which process of a job uses it ("rank2"), for a store that keeps something
  /// per process where the job's processes meet (`FileStore::set_owner`: its files' names); a
  /// store without a `set_owner(const std::string&)` ignores it. `distributed::Pipe` calls it.
  void set_owner(const std::string& owner) { self_->set_owner(owner); }

  /// Whether the store keeps activations (models `offload_store`) and optimizer state (models
  /// `state_store`); the calls of what it does not keep are an error naming the fix.
  bool keeps_activations() const { return self_->keeps_activations(); }
  bool keeps_state() const { return self_->keeps_state(); }
  /// The store's `state_store` calls (see there): `key`'s kept state, a copy to change.
  std::optional<optim::StateRecord> read_state(const std::string& key) {
    return self_->read_state(key);
  }
  /// Stages `record` as `key`'s new state, kept by `commit_state` or dropped by `discard_state`.
  void write_state(const std::string& key, optim::StateRecord record) {
    self_->write_state(key, std::move(record));
  }
  /// Every staged state becomes the kept one.
  void commit_state() { self_->commit_state(); }
  /// Every staged state is dropped; the kept ones stay.
  void discard_state() { self_->discard_state(); }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual void begin_step(const std::vector<int>& stages) = 0;
    virtual void put(const StoreKey& key, std::vector<torch::Tensor> tensors) = 0;
    virtual std::vector<torch::Tensor> take(const StoreKey& key, const torch::Device& device) = 0;
    virtual std::string describe() = 0;
    virtual void set_owner(const std::string& owner) = 0;
    virtual bool keeps_activations() const = 0;
    virtual bool keeps_state() const = 0;
    virtual std::optional<optim::StateRecord> read_state(const std::string& key) = 0;
    virtual void write_state(const std::string& key, optim::StateRecord record) = 0;
    virtual void commit_state() = 0;
    virtual void discard_state() = 0;
  };
  template <class S>
  struct Model final : Concept {
    explicit Model(S s) : store(std::move(s)) {}
    void begin_step(const std::vector<int>& stages) override {
      if constexpr (offload_store<S>) {
        store.begin_step(stages);
      } else {
        refuse("activations (it is not a runtime::offload_store)",
               "give the activations a HostStore or a FileStore, or add begin_step, put and take "
               "to the store");
      }
    }
    void put(const StoreKey& key, std::vector<torch::Tensor> tensors) override {
      if constexpr (offload_store<S>) store.put(key, std::move(tensors));
    }
    std::vector<torch::Tensor> take(const StoreKey& key, const torch::Device& device) override {
      if constexpr (offload_store<S>) {
        return store.take(key, device);
      } else {
        (void)key;
        (void)device;
        return {};
      }
    }
    std::string describe() override { return store.describe(); }
    void set_owner(const std::string& owner) override {
      if constexpr (requires { store.set_owner(owner); }) store.set_owner(owner);
    }
    bool keeps_activations() const override { return offload_store<S>; }
    bool keeps_state() const override { return state_store<S>; }
    std::optional<optim::StateRecord> read_state(const std::string& key) override {
      if constexpr (state_store<S>) {
        return store.read_state(key);
      } else {
        refuse_state();
        (void)key;
        return std::nullopt;
      }
    }
    void write_state(const std::string& key, optim::StateRecord record) override {
      if constexpr (state_store<S>) {
        store.write_state(key, std::move(record));
      } else {
        refuse_state();
        (void)key;
        (void)record;
      }
    }
    void commit_state() override {
      if constexpr (state_store<S>) store.commit_state();
    }
    void discard_state() override {
      if constexpr (state_store<S>) store.discard_state();
    }
    void refuse_state() {
      refuse("optimizer state (it is not a runtime::state_store)",
             "give the optimizer's state a HostStore or a FileStore, or add read_state, "
             "write_state, commit_state and discard_state to the store");
    }
    void refuse(const char* what, const char* fix) {
      TORCH_CHECK(false, "stagewise::", store.describe(), " keeps no ", what, "; ", fix);
    }
    S store;
  };
  std::shared_ptr<Concept> self_;
};

static_assert(offload_store<AnyStore>);
static_assert(state_store<AnyStore>);

}  // namespace stagewise::runtime
