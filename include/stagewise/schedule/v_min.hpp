#pragma once

#include "stagewise/schedule/detail/capped_v.hpp"

#include <string_view>

namespace stagewise::schedule {

/// V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362): 2K
/// stages in a V on K workers like ZB-V (worker w runs stages w and 2K-1-w), each worker holding
/// at most (K+4)/3 micro-batches of activations (rounded down; in cells of half a worker's model,
/// 2 x (K+4)/3), about a third of 1F1B's K. Backwards are split into I and W; the order is
/// list-scheduled under that cap with T_F = T_B = T_W. Its step takes about as long as 1F1B's
/// (a little longer at K = 4, less from K = 8 with M >= 2K): pick it when even V-Half's
/// activations do not fit.
///   pipe8->train_step(x, y, loss_fn, stagewise::schedule::v_min{});  // 8 stages, 4 workers
///   stagewise::schedule::v_min{}.peak_cells(8);  // 4: 2 micro-batches, 1F1B holds 4
struct v_min : detail::capped_v<v_min> {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "v_min";
  /// The name its paper gives it.
  static constexpr std::string_view title = "V-Min";
  /// Cells per worker on `workers` workers: 2 x floor((K+4)/3).
  static int cells(int workers) { return 2 * ((workers + 4) / 3); }
};

}  // namespace stagewise::schedule
