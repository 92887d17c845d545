#pragma once

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <concepts>
#include <memory>
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

/// Any `offload_store`, shared: copies of an AnyStore (e.g. of the PipeOptions holding it) are
/// one store, so its buffers and files live across steps.
///   stagewise::runtime::AnyStore store(stagewise::runtime::FileStore("/nvme/offload"));
class AnyStore {
 public:
  template <offload_store S>
  requires(!std::same_as<std::decay_t<S>, AnyStore>)
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

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual void begin_step(const std::vector<int>& stages) = 0;
    virtual void put(const StoreKey& key, std::vector<torch::Tensor> tensors) = 0;
    virtual std::vector<torch::Tensor> take(const StoreKey& key, const torch::Device& device) = 0;
    virtual std::string describe() = 0;
    virtual void set_owner(const std::string& owner) = 0;
  };
  template <class S>
  struct Model final : Concept {
    explicit Model(S s) : store(std::move(s)) {}
    void begin_step(const std::vector<int>& stages) override { store.begin_step(stages); }
    void put(const StoreKey& key, std::vector<torch::Tensor> tensors) override {
      store.put(key, std::move(tensors));
    }
    std::vector<torch::Tensor> take(const StoreKey& key, const torch::Device& device) override {
      return store.take(key, device);
    }
    std::string describe() override { return store.describe(); }
    void set_owner(const std::string& owner) override {
      if constexpr (requires { store.set_owner(owner); }) store.set_owner(owner);
    }
    S store;
  };
  std::shared_ptr<Concept> self_;
};

static_assert(offload_store<AnyStore>);

}  // namespace stagewise::runtime
