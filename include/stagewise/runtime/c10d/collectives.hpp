#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <concepts>
#include <functional>
#include <vector>

namespace stagewise::runtime {

/// A c10d process group (or, in LibTorch 2.x, a backend) with the two collectives data
/// parallelism needs: `c10d::ProcessGroupGloo`, `c10d::ProcessGroupNCCL`, `c10d::ProcessGroup`.
///   static_assert(stagewise::runtime::collective_group<c10d::ProcessGroupGloo>);
template <class G>
concept collective_group = requires(G& g, std::vector<at::Tensor>& t,
                                    const c10d::AllreduceOptions& a,
                                    const c10d::BroadcastOptions& b) {
  { g.allreduce(t, a) } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  { g.broadcast(t, b) } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  { g.getRank() } -> std::convertible_to<int>;
  { g.getSize() } -> std::convertible_to<int>;
};

/// The collectives stagewise needs from a process group, whatever its class in this LibTorch
/// version: a summing all-reduce and a broadcast, each started asynchronously (wait on the
/// returned work), plus this process's rank and the group's size. Empty (`!*this`) when
/// default-constructed.
///   stagewise::runtime::Collectives c(my_process_group);
///   auto work = c.all_reduce_sum(tensors);
///   work->wait();
class Collectives {
 public:
  Collectives() = default;

  template <collective_group G>
  explicit Collectives(c10::intrusive_ptr<G> group)
      : all_reduce_([group](std::vector<at::Tensor>& t) {
          c10d::AllreduceOptions o;
          o.reduceOp = c10d::ReduceOp::SUM;
          return c10::intrusive_ptr<c10d::Work>(group->allreduce(t, o));
        }),
        broadcast_([group](std::vector<at::Tensor>& t, int root) {
          c10d::BroadcastOptions o;
          o.rootRank = root;
          return c10::intrusive_ptr<c10d::Work>(group->broadcast(t, o));
        }),
        rank_(group->getRank()),
        size_(group->getSize()) {}

  explicit operator bool() const { return static_cast<bool>(all_reduce_); }

  /// Starts summing each of `tensors` over the group, in place. Every rank must start the same
  /// collectives in the same order.
  c10::intrusive_ptr<c10d::Work> all_reduce_sum(std::vector<at::Tensor>& tensors) const {
    return all_reduce_(tensors);
  }
  /// Starts copying rank `root`'s `tensors` into every other rank's, in place.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, int root) const {
    return broadcast_(tensors, root);
  }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&)> all_reduce_;
  std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&, int)> broadcast_;
  int rank_ = 0;
  int size_ = 1;
};

/// Copies rank `root`'s `tensors` into every other rank's of `group`, in place, one broadcast
/// each, and waits for them (every rank passes tensors of the same shapes, in the same order).
inline void broadcast_each(const Collectives& group, const std::vector<at::Tensor>& tensors,
                           int root) {
  for (const auto& t : tensors) {
    std::vector<at::Tensor> one{t};
    group.broadcast(one, root)->wait();
  }
}

}  // namespace stagewise::runtime
