#pragma once

#include "stagewise/schedule/detail/capped_v.hpp"

#include <string_view>

namespace stagewise::schedule {

/// V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362): 2K
/// stages in a V on K workers like ZB-V (worker w runs stages w and 2K-1-w), each worker holding
/// at most (K+2)/2 micro-batches of activations (rounded down; in cells of half a worker's model,
/// 2 x (K+2)/2), about half of 1F1B's K, where ZB-V holds K. Backwards are split into I and W;
/// the order is list-scheduled under that cap with T_F = T_B = T_W. Its bubble is about half of
/// 1F1B's: pick it when 1F1B's activations do not fit and its step time must not grow.
///   pipe8->train_step(x, y, loss_fn, stagewise::schedule::v_half{});  // 8 stages, 4 workers
///   stagewise::schedule::v_half{}.peak_cells(8);  // 6: 3 micro-batches, 1F1B holds 4
struct v_half : detail::capped_v<v_half> {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "v_half";
  /// The name its paper gives it.
  static constexpr std::string_view title = "V-Half";
  /// Cells per worker on `workers` workers: 2 x floor((K+2)/2).
  static int cells(int workers) { return 2 * ((workers + 2) / 2); }
};

}  // namespace stagewise::schedule
