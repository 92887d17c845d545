#pragma once

#include "stagewise/runtime/c10d/group.hpp"

#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// What C10dTransport's sender and receiver share: the process group, whose point-to-point calls
// one lock serialises (a message's sends go out together, and a process group's calls may share
// state), and the job ranks its errors name.
struct Link {
  explicit Link(const Connection& c) : group(c.group), job_ranks(c.job_ranks) {}

  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  int rank() const { return group.rank(); }
  // The job rank of this group's rank `r` (they differ in a subgroup of a larger job).
  int job_rank(int r) const {
    return job_ranks.empty() ? r : job_ranks.at(static_cast<std::size_t>(r));
  }
  std::string name_of(int r) const { return std::to_string(job_rank(r)); }

  PointToPoint group;
  std::mutex post;             // held while posting sends and receives on `group`
  std::vector<int> job_ranks;  // of each group rank; empty: the group is the job
};

}  // namespace stagewise::runtime::detail
