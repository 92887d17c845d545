#pragma once

// A GradientReducer's parameters and buckets (runtime/c10d/gradient_reducer.hpp), and how the
// buckets are laid out: gradients grouped in the reverse order of the parameters into buckets of
// one dtype and device; sharded, each bucket's parameters placed owner by owner.

#include "stagewise/optim/shard_owners.hpp"
#include "stagewise/runtime/c10d/detail/shard_reduction.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

struct ReducerParam {
  torch::Tensor tensor;
  std::string name;
  std::shared_ptr<torch::autograd::Node> accumulator;
  std::uintptr_t hook_key = 0;
  const torch::autograd::FunctionPreHook* pre_hook = nullptr;  // sharded: ours on `accumulator`
  std::size_t bucket = 0;
  std::int64_t offset = 0;        // in its bucket's flat tensor
  int owner = 0;                  // sharded: the rank that owns it (else 0, unused)
  std::int64_t shard_offset = 0;  // sharded: in its owner's slice of the bucket
};

struct ReducerBucket {
  std::vector<std::size_t> members;
  std::int64_t numel = 0;
  std::size_t pending = 0;
  bool launched = false;
  torch::Tensor flat;
  c10::intrusive_ptr<c10d::Work> work;
  BucketShard shard;  // sharded only
};

// Groups `params` into buckets of at most `bucket_bytes` (one dtype and device each), in the
// reverse order of `params`, where backward usually finishes them. With `replicas` > 0 the
// parameters are sharded over that many ranks (`optim::shard_owners`) and each bucket's flat
// tensor holds owner 0's parameters, then owner 1's, and so on.
inline std::vector<ReducerBucket> plan_reducer_buckets(std::vector<ReducerParam>& params,
                                                       std::int64_t bucket_bytes, int replicas) {
  std::vector<ReducerBucket> buckets;
  std::map<std::pair<int, std::string>, std::size_t> open;  // (dtype, device) -> bucket
  for (std::size_t k = params.size(); k-- > 0;) {
    const auto& t = params[k].tensor;
    const auto key = std::make_pair(static_cast<int>(t.scalar_type()), t.device().str());
    auto it = open.find(key);
    const auto bytes = static_cast<std::int64_t>(t.numel() * t.element_size());
    if (it != open.end()) {
      const auto& b = buckets[it->second];
      const auto element = static_cast<std::int64_t>(t.element_size());
      if ((b.numel * element) + bytes > bucket_bytes) open.erase(it);
    }
    it = open.find(key);
    if (it == open.end()) {
      buckets.emplace_back();
      it = open.emplace(key, buckets.size() - 1).first;
    }
    auto& b = buckets[it->second];
    params[k].bucket = it->second;
    params[k].offset = b.numel;
    b.members.push_back(k);
    b.numel += t.numel();
  }
  if (replicas <= 0) return buckets;
  std::vector<std::int64_t> bytes;
  for (const auto& p : params) bytes.push_back(p.tensor.numel() * p.tensor.element_size());
  const auto owners = optim::shard_owners(bytes, replicas);
  for (std::size_t k = 0; k < params.size(); ++k) params[k].owner = owners[k];
  for (auto& b : buckets) {
    b.shard.slices.assign(static_cast<std::size_t>(replicas), ShardSlice{});
    std::int64_t at = 0;
    for (int o = 0; o < replicas; ++o) {
      auto& slice = b.shard.slices[static_cast<std::size_t>(o)];
      slice.offset = at;
      for (const auto k : b.members) {
        auto& p = params[k];
        if (p.owner != o) continue;
        p.offset = at;
        p.shard_offset = at - slice.offset;
        at += p.tensor.numel();
      }
      slice.numel = at - slice.offset;
    }
  }
  return buckets;
}

}  // namespace stagewise::runtime::detail
