#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace stagewise::runtime {

/// A c10d process group (or, in LibTorch 2.x, a backend) with the collectives stagewise needs:
/// `c10d::ProcessGroupGloo`, `c10d::ProcessGroupNCCL`, `c10d::ProcessGroup`.
///   static_assert(stagewise::runtime::collective_group<c10d::ProcessGroupGloo>);
template <class G>
concept collective_group = requires(G& g, std::vector<at::Tensor>& t,
                                    std::vector<std::vector<at::Tensor>>& out, at::Tensor& one,
                                    std::vector<std::int64_t>& counts,
                                    const c10d::AllreduceOptions& a,
                                    const c10d::BroadcastOptions& b,
                                    const c10d::AllgatherOptions& ag, const c10d::ReduceOptions& r,
                                    const c10d::AllToAllOptions& aa) {
  { g.allreduce(t, a) } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  { g.broadcast(t, b) } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  { g.allgather(out, t, ag) } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  { g.reduce(t, r) } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  {
    g.alltoall_base(one, one, counts, counts, aa)
    } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  { g.getRank() } -> std::convertible_to<int>;
  { g.getSize() } -> std::convertible_to<int>;
};

/// The collectives stagewise needs from a process group, whatever its class in this LibTorch
/// version: a summing all-reduce, a broadcast, an all-gather, a summing reduce to one rank and an
/// all-to-all of uneven pieces, each started asynchronously (wait on the returned work), plus
/// this process's rank and the group's size. Empty (`!*this`) when default-constructed.
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
        all_gather_([group](std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& t) {
          return c10::intrusive_ptr<c10d::Work>(group->allgather(out, t, c10d::AllgatherOptions()));
        }),
        reduce_([group](std::vector<at::Tensor>& t, int root) {
          c10d::ReduceOptions o;
          o.reduceOp = c10d::ReduceOp::SUM;
          o.rootRank = root;
          return c10::intrusive_ptr<c10d::Work>(group->reduce(t, o));
        }),
        all_to_all_([group](at::Tensor& out, at::Tensor& in, std::vector<std::int64_t>& out_counts,
                            std::vector<std::int64_t>& in_counts) {
          return c10::intrusive_ptr<c10d::Work>(
              group->alltoall_base(out, in, out_counts, in_counts, c10d::AllToAllOptions()));
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
  /// Starts copying every rank's `tensors` into `out[i][r]` of every rank (rank r's tensor i);
  /// each rank passes tensors of the same shapes and `out[i]` of size() tensors shaped alike.
  c10::intrusive_ptr<c10d::Work> all_gather(std::vector<std::vector<at::Tensor>>& out,
                                            std::vector<at::Tensor>& tensors) const {
    return all_gather_(out, tensors);
  }
  /// Starts summing `tensors` over the group into rank `root`'s, in place (the others' are left
  /// with partial sums: scratch). Every rank passes tensors of the same shapes.
  c10::intrusive_ptr<c10d::Work> reduce_sum(std::vector<at::Tensor>& tensors, int root) const {
    return reduce_(tensors, root);
  }
  /// Starts sending piece r of `input` (its first dimension cut into `in_counts`) to rank r and
  /// receiving rank r's piece for this rank into piece r of `output` (cut into `out_counts`):
  /// every rank's `in_counts[r]` equals rank r's `out_counts[me]`.
  c10::intrusive_ptr<c10d::Work> all_to_all(at::Tensor& output, at::Tensor& input,
                                            std::vector<std::int64_t>& out_counts,
                                            std::vector<std::int64_t>& in_counts) const {
    return all_to_all_(output, input, out_counts, in_counts);
  }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&)> all_reduce_;
  std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&, int)> broadcast_;
  std::function<c10::intrusive_ptr<c10d::Work>(std::vector<std::vector<at::Tensor>>&,
                                               std::vector<at::Tensor>&)>
      all_gather_;
  std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&, int)> reduce_;
  std::function<c10::intrusive_ptr<c10d::Work>(at::Tensor&, at::Tensor&, std::vector<std::int64_t>&,
                                               std::vector<std::int64_t>&)>
      all_to_all_;
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

/// Every rank's `values` (a 1-D float64 tensor, whose length may differ between ranks) in the
/// group's rank order, on the CPU, exactly, by all-gathering `room` + 1 numbers per rank: the
/// length, then the values, padded. `room` (every rank's the same; start it at 0) is kept between
/// calls: when a rank's values do not fit, every rank sees it, widens `room` alike and gathers
/// once more, so a steady exchange costs one all-gather. The tensors travel on `device` (the CPU
/// for Gloo, a GPU for NCCL); `wait(work)` waits for each collective (e.g. through
/// `C10dTransport::wait_collective`, which fails with the job); `post`, if given, is held while
/// each is started (the lock of other calls on the same group). Every rank starts the group's
/// collectives in the same order.
///   std::int64_t room = 0;
///   auto all = stagewise::runtime::all_gather_values(
///       c.collectives, torch::tensor({1.0, 2.0}, torch::kDouble), torch::kCPU,
///       [](const c10::intrusive_ptr<c10d::Work>& w) { w->wait(); }, room);
inline std::vector<at::Tensor> all_gather_values(
    const Collectives& group, const at::Tensor& values, const c10::Device& device,
    const std::function<void(const c10::intrusive_ptr<c10d::Work>&)>& wait, std::int64_t& room,
    std::mutex* post = nullptr) {
  TORCH_CHECK(values.dim() == 1 && values.scalar_type() == at::kDouble,
              "stagewise::runtime::all_gather_values: give a 1-D float64 tensor, not a ",
              values.dim(), "-D ", values.scalar_type(), " one");
  const auto n = values.numel();
  auto gather = [&] {
    auto mine = at::zeros({room + 1}, at::TensorOptions().dtype(at::kDouble).device(device));
    mine[0] = static_cast<double>(n);
    if (n <= room) mine.narrow(0, 1, n).copy_(values);
    std::vector<at::Tensor> in{mine};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < group.size(); ++r) out[0].push_back(at::empty_like(mine));
    c10::intrusive_ptr<c10d::Work> work;
    {
      std::unique_lock<std::mutex> lock;
      if (post != nullptr) lock = std::unique_lock<std::mutex>(*post);
      work = group.all_gather(out, in);
    }
    wait(work);
    std::vector<at::Tensor> all;
    for (const auto& t : out[0]) all.push_back(t.to(at::kCPU));
    return all;
  };
  auto longest = [](const std::vector<at::Tensor>& all) {
    std::int64_t most = 0;
    for (const auto& t : all) most = std::max(most, static_cast<std::int64_t>(t[0].item<double>()));
    return most;
  };
  auto all = gather();
  if (const auto most = longest(all); most > room) {
    room = most;  // the same on every rank: each saw every length
    all = gather();
  }
  std::vector<at::Tensor> out;
  for (const auto& t : all) {
    out.push_back(t.narrow(0, 1, static_cast<std::int64_t>(t[0].item<double>())));
  }
  return out;
}

}  // namespace stagewise::runtime
