#pragma once

// The sharded (ZeRO) half of a GradientReducer (runtime/c10d/gradient_reducer.hpp): a bucket laid
// out owner by owner, its sum brought to each owner only (a reduce-scatter built from what the
// process group has), and the owners' updated parameters sent back to every rank.

#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/reducer_options.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// How one bucket's gradients are summed to their owners: `slices[o]` is owner o's part of the
// flat bucket (its parameters, one after another).
struct ShardSlice {
  std::int64_t offset = 0;
  std::int64_t numel = 0;
};

using AwaitWork = std::function<void(const c10::intrusive_ptr<c10d::Work>&, const std::string&)>;

// One bucket's reduce-scatter: started from the flat copy of its gradients, retired into this
// rank's averaged part (`mine`, undefined when it owns nothing here) once its work completed.
struct BucketShard {
  std::vector<ShardSlice> slices;  // per owner
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  torch::Tensor flat;      // the gradients' copy, while they travel
  torch::Tensor received;  // all_to_all: every rank's piece of this rank's slice
  torch::Tensor mine;      // after retire(): this rank's slice of the average
  bool retired = true;

  const ShardSlice& slice_of(int rank) const { return slices[static_cast<std::size_t>(rank)]; }

  // Starts summing `gradients` (the bucket's flat copy, laid out by owner) to each owner.
  void launch(const Collectives& group, ReduceScatter how, torch::Tensor gradients) {
    flat = std::move(gradients);
    works.clear();
    retired = false;
    const int me = group.rank(), d = group.size();
    switch (how) {
      case ReduceScatter::reduce:
        // One reduce per owner, in place: the owner's slice ends up holding the sum.
        for (int o = 0; o < d; ++o) {
          const auto& s = slice_of(o);
          if (s.numel == 0) continue;  // every rank skips it alike: the layout is the same
          std::vector<at::Tensor> one{flat.narrow(0, s.offset, s.numel)};
          works.push_back(group.reduce_sum(one, o));
        }
        break;
      case ReduceScatter::all_to_all: {
        // Owner o receives every rank's copy of its slice and sums them itself.
        std::vector<std::int64_t> in, out(static_cast<std::size_t>(d), slice_of(me).numel);
        for (const auto& s : slices) in.push_back(s.numel);
        received = torch::empty({slice_of(me).numel * d}, flat.options());
        works.push_back(group.all_to_all(received, flat, out, in));
        break;
      }
      case ReduceScatter::all_reduce: {
        std::vector<at::Tensor> one{flat};
        works.push_back(group.all_reduce_sum(one));
        break;
      }
    }
  }

  // Whether every work is done and succeeded (a failed one is left to be waited for, which
  // reports it).
  bool done() {
    for (const auto& w : works) {
      if (!w->isCompleted() || !w->isSuccess()) return false;
    }
    return true;
  }

  // Once the works completed: adds this rank's slice of the sum divided by `d` to `mine` (which
  // a reduction per pass accumulates; undefined at the start of a step), summing the pieces in
  // rank order where this process sums them (all_to_all), and frees the rest.
  void retire(int me, int d, ReduceScatter how) {
    if (retired) return;
    torch::NoGradGuard no_grad;
    const auto& s = slice_of(me);
    if (s.numel > 0) {
      torch::Tensor part;
      if (how == ReduceScatter::all_to_all) {
        part = received.narrow(0, 0, s.numel).clone();
        for (int r = 1; r < d; ++r) part.add_(received.narrow(0, r * s.numel, s.numel));
      } else {
        part = flat.narrow(0, s.offset, s.numel).clone();
      }
      part.div_(static_cast<float>(d));  // as the unsharded reducer divides its sum
      if (mine.defined()) {
        mine.add_(part);
      } else {
        mine = std::move(part);
      }
    }
    flat = torch::Tensor();
    received = torch::Tensor();
    works.clear();
    retired = true;
  }
};

// The owners' updated parameters on their way to every rank: one broadcast per owner and bucket,
// in the order every rank issues them (bucket by bucket, owner by owner). A slice of one tensor is
// broadcast in place; several are packed into one flat tensor and unpacked on arrival.
class ParameterGather {
 public:
  // Sends owner `owner`'s `params` (the bucket's members it owns, in layout order) from it to
  // every rank of `group`.
  void launch(const Collectives& group, int owner, const std::vector<torch::Tensor>& params,
              std::int64_t numel) {
    if (numel == 0) return;
    torch::NoGradGuard no_grad;
    Piece piece;
    piece.owner = owner;
    const bool mine = group.rank() == owner;
    if (params.size() == 1 && params.front().is_contiguous()) {
      piece.flat = params.front().detach();  // in place: its storage is the parameter's
    } else {
      piece.params = params;
      if (mine) {
        std::vector<torch::Tensor> flat;
        for (const auto& p : params) flat.push_back(p.detach().reshape({-1}));
        piece.flat = torch::cat(flat);
      } else {
        piece.flat = torch::empty({numel}, params.front().options());
      }
    }
    std::vector<at::Tensor> one{piece.flat};
    piece.work = group.broadcast(one, owner);
    piece.unpack = !mine && !piece.params.empty();
    pieces_.push_back(std::move(piece));
  }

  // Waits for every piece sent so far (each through `await`) and writes the received values into
  // the parameters.
  void wait(const AwaitWork& await) {
    auto pieces = std::move(pieces_);
    pieces_.clear();
    torch::NoGradGuard no_grad;
    for (auto& piece : pieces) {
      await(piece.work, "the updated parameters of replica " + std::to_string(piece.owner));
      if (!piece.unpack) continue;
      std::int64_t at = 0;
      for (auto& p : piece.params) {
        p.detach().copy_(piece.flat.narrow(0, at, p.numel()).view(p.sizes()));
        at += p.numel();
      }
    }
  }

  bool pending() const { return !pieces_.empty(); }

 private:
  struct Piece {
    int owner = 0;
    torch::Tensor flat;
    std::vector<torch::Tensor> params;  // to unpack into; empty: received in place
    c10::intrusive_ptr<c10d::Work> work;
    bool unpack = false;
  };
  std::vector<Piece> pieces_;
};

}  // namespace stagewise::runtime::detail
