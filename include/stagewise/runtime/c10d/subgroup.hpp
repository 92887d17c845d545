#pragma once

#include "stagewise/runtime/c10d/group.hpp"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// A process group of some ranks of a joined job (`members`: their job ranks, in group-rank
/// order; this process must be one of them), over the job's store under the key prefix `name`,
/// which must differ between the job's groups. Only the members call it, all with the same
/// arguments. The result keeps the job's store unprefixed (a failure published by any rank of the
/// job reaches every group) and the job's collectives (`Connection::across_job`), and errors and
/// failures name job ranks (`Connection::job_ranks`).
///   auto row = stagewise::runtime::subgroup(job, {0, 1}, "stagewise/replica0");
inline Connection subgroup(const Connection& job, std::vector<int> members, const std::string& name,
                           const ConnectOptions& options = {}) {
  const auto it = std::find(members.begin(), members.end(), job.env.rank);
  TORCH_CHECK(it != members.end(), "stagewise::runtime::subgroup: rank ", job.env.rank,
              " is not one of the group ", name, "'s members; only its members build it");
  for (std::size_t i = 0; i < members.size(); ++i) {
    TORCH_CHECK(members[i] >= 0 && members[i] < job.job_world(),
                "stagewise::runtime::subgroup: member ", members[i], " of ", name,
                " is not a rank of the job of ", job.job_world());
  }
  RendezvousEnv env = job.env;
  env.rank = static_cast<int>(it - members.begin());
  env.world_size = static_cast<int>(members.size());
  std::vector<int> job_ranks;
  for (const int r : members) job_ranks.push_back(job.job_rank(r));
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, job.store);
  auto [p2p, collectives] = detail::make_group(
      prefixed, env.rank, env.world_size, job.env.master_addr, options,
      job.env.master_addr + ":" + std::to_string(job.env.master_port) + " (" + name + ")");
  return Connection{env,
                    job.store,
                    std::move(p2p),
                    job.serves_store,
                    std::move(collectives),
                    std::move(job_ranks),
                    job.job_world(),
                    job.across_job()};
}

}  // namespace stagewise::runtime
