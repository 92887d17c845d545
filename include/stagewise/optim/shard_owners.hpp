#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace stagewise::optim {

/// Which of `replicas` data-parallel replicas owns each tensor when optimizer state is sharded
/// (ZeRO): whole tensors, balanced by size. Tensors are taken largest first (ties: the earlier
/// one) and each goes to the replica that owns the fewest bytes so far (ties: the lower replica),
/// so every rank computes the same owners from the same sizes. An owner keeps its tensors'
/// optimizer state and steps them with LibTorch's own optimizer over the whole tensor, which is
/// why a sharded step equals the unsharded one bit for bit where the gradients do. One tensor
/// larger than the rest together (an embedding) makes its owner hold more than 1/d of the state:
/// `shard_loads` says how much.
///   auto owners = stagewise::optim::shard_owners({4096, 1024, 1024, 64}, 2);  // {0, 1, 1, 1}
inline std::vector<int> shard_owners(const std::vector<std::int64_t>& bytes, int replicas) {
  TORCH_CHECK(replicas >= 1, "stagewise::optim::shard_owners: ", replicas,
              " replicas; give 1 or more");
  std::vector<std::size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return bytes[a] > bytes[b]; });
  std::vector<std::int64_t> load(static_cast<std::size_t>(replicas), 0);
  std::vector<int> owners(bytes.size(), 0);
  for (const auto i : order) {
    TORCH_CHECK(bytes[i] >= 0, "stagewise::optim::shard_owners: tensor ", i, " has ", bytes[i],
                " bytes; give sizes of 0 or more");
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owners[i] = static_cast<int>(least);
    load[static_cast<std::size_t>(least)] += bytes[i];
  }
  return owners;
}

/// The bytes each of `replicas` replicas owns under `owners` (`shard_owners`).
///   stagewise::optim::shard_loads({4096, 1024, 1024, 64}, {0, 1, 1, 1}, 2);  // {4096, 2112}
inline std::vector<std::int64_t> shard_loads(const std::vector<std::int64_t>& bytes,
                                             const std::vector<int>& owners, int replicas) {
  TORCH_CHECK(bytes.size() == owners.size(), "stagewise::optim::shard_loads: ", bytes.size(),
              " sizes but ", owners.size(), " owners; give one owner per tensor");
  std::vector<std::int64_t> load(static_cast<std::size_t>(std::max(replicas, 1)), 0);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    TORCH_CHECK(owners[i] >= 0 && owners[i] < replicas, "stagewise::optim::shard_loads: owner ",
                owners[i], " of tensor ", i, " is not one of the ", replicas, " replicas");
    load[static_cast<std::size_t>(owners[i])] += bytes[i];
  }
  return load;
}

/// The largest replica's share of the bytes under `owners`, times `replicas`: 1 when the shard
/// is even, up to `replicas` when one tensor holds nearly everything. The sharded state a rank
/// holds is this factor times 1/d of the whole.
///   stagewise::optim::shard_imbalance({4096, 1024, 1024, 64}, {0, 1, 1, 1}, 2);  // 1.32
inline double shard_imbalance(const std::vector<std::int64_t>& bytes,
                              const std::vector<int>& owners, int replicas) {
  const auto load = shard_loads(bytes, owners, replicas);
  const auto total = std::accumulate(load.begin(), load.end(), std::int64_t{0});
  if (total == 0) return 1.0;
  const auto most = *std::max_element(load.begin(), load.end());
  return static_cast<double>(most) * replicas / static_cast<double>(total);
}

}  // namespace stagewise::optim
