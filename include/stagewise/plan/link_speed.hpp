#pragma once

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace stagewise {

/// How fast the ranks of a job exchange bytes, for `plan_pipeline`'s cost of the replicas'
/// gradient exchange: a message's fixed cost (`latency_seconds`) and the bytes per second one rank
/// sends while every rank sends at once (`bytes_per_second`). Give it
/// (`PlanOptions().link(LinkSpeed{.latency_seconds = 30e-6, .bytes_per_second = 10e9})`) or
/// measure it once over the job's own process group (`distributed::measure_link`). The
/// collectives are costed as rings: an all-reduce of B bytes over n ranks takes 2(n-1) steps of
/// one message of B/n bytes each, a reduce-scatter or an all-gather n-1 of them.
///   const auto t = sw::LinkSpeed{.latency_seconds = 30e-6, .bytes_per_second = 1e9}
///                      .all_reduce_seconds(100e6, 4);  // 0.15 s
struct LinkSpeed {
  double latency_seconds = 0;
  double bytes_per_second = std::numeric_limits<double>::infinity();

  /// Seconds for an all-reduce of `bytes` over `ranks` ranks (0 for one rank).
  double all_reduce_seconds(double bytes, int ranks) const {
    return 2.0 * ring_step_seconds(bytes, ranks);
  }
  /// Seconds for a reduce-scatter of `bytes` (each rank ends with its 1/ranks of the sum).
  double reduce_scatter_seconds(double bytes, int ranks) const {
    return ring_step_seconds(bytes, ranks);
  }
  /// Seconds for an all-gather that leaves `bytes` on every rank (each gave 1/ranks of them).
  double all_gather_seconds(double bytes, int ranks) const {
    return ring_step_seconds(bytes, ranks);
  }

  /// "30 us + 1.2 GB/s" (or "free" for a link that costs nothing).
  std::string to_string() const {
    std::ostringstream s;
    s.precision(3);
    if (latency_seconds == 0 && std::isinf(bytes_per_second)) return "free";
    s << latency_seconds * 1e6 << " us + ";
    if (std::isinf(bytes_per_second)) {
      s << "unlimited bandwidth";
    } else {
      s << bytes_per_second / 1e9 << " GB/s";
    }
    return s.str();
  }

  /// Refuses a speed no link has (negative latency, bandwidth not above 0), naming `who`.
  void check(const char* who) const {
    TORCH_CHECK(latency_seconds >= 0 && std::isfinite(latency_seconds), who,
                ": the link's latency is ", latency_seconds,
                " seconds; give 0 or more (e.g. 30e-6), or measure it with "
                "distributed::measure_link");
    TORCH_CHECK(bytes_per_second > 0, who, ": the link's speed is ", bytes_per_second,
                " bytes per second; give a positive speed (e.g. 10e9), or measure it with "
                "distributed::measure_link");
  }

 private:
  // n-1 ring steps of one message of bytes/n each.
  double ring_step_seconds(double bytes, int ranks) const {
    if (ranks <= 1) return 0.0;
    const double n = ranks;
    return (n - 1.0) * (latency_seconds + bytes / n / bytes_per_second);
  }
};

}  // namespace stagewise
