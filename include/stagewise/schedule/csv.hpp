#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/detail/replay.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace stagewise::schedule {

/// A schedule read from PyTorch's CSV format (see `from_csv`): one list of actions per rank, and
/// the rank of every stage as the rows say. It is a `pipeline_schedule` (and places its stages
/// itself), so it runs, verifies, simulates and draws like a built-in one, for the number of
/// stages and micro-batches the file names.
///   auto s = stagewise::schedule::from_csv("0F0,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n");
///   pipe->train_step(x, y, loss_fn, s);  // 2 stages, 2 micro-batches
struct csv_schedule {
  /// Its name (`named_schedule`): `any_schedule(s)` calls it "csv".
  static constexpr std::string_view name = "csv";
  /// As pictures title it.
  static constexpr std::string_view title = "CSV";

  int stages = 0;                          ///< 1 + the largest stage in the file
  int micro_batches = 0;                   ///< 1 + the largest micro-batch in the file
  std::vector<std::vector<Action>> ranks;  ///< per rank (row), in order
  std::vector<int> placement;              ///< the rank of each stage

  /// The number of ranks (rows); `stages` must be the file's.
  int workers(int n) const {
    check(n, micro_batches);
    return static_cast<int>(ranks.size());
  }
  /// The rank whose row holds `stage`'s actions.
  int worker_of(int stage, int n) const {
    check(n, micro_batches);
    return placement[static_cast<std::size_t>(stage)];
  }
  coro::generator<Action> operator()(int n, int m) const {
    check(n, m);
    for (const auto& row : ranks) {
      for (const auto& a : row) co_yield a;
    }
  }

 private:
  void check(int n, int m) const {
    TORCH_CHECK(n == stages && m == micro_batches,
                "stagewise::schedule::csv_schedule: the CSV "
                "schedule is for ",
                stages, " stages and ", micro_batches,
                " micro-batches, asked "
                "for ",
                n, " and ", m, "; give the pipe ", stages, " stages and ", "PipeOptions().chunks(",
                micro_batches, ")");
  }
};

namespace detail {

inline std::string csv_trim(const std::string& s) {
  std::size_t b = 0;
  std::size_t e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  std::string out = s.substr(b, e - b);
  if (out.size() >= 2 && out.front() == '"' && out.back() == '"')
    out = out.substr(1, out.size() - 2);
  return out;
}

// Parses one action such as "2I0" into `out` (nothing for communication and sharding actions,
// which stagewise does itself); returns what is wrong with it, or "".
inline std::string csv_action(const std::string& s, std::vector<Action>& out) {
  std::size_t p = 0;
  while (p < s.size() && std::isdigit(static_cast<unsigned char>(s[p]))) ++p;
  if (p == 0) return "it does not start with a stage number";
  const std::string type_and_micro = s.substr(p);
  std::size_t q = type_and_micro.size();
  while (q > 0 && std::isdigit(static_cast<unsigned char>(type_and_micro[q - 1]))) --q;
  const std::string type = type_and_micro.substr(0, q);
  const std::string micro = type_and_micro.substr(q);
  for (const char* ignored :
       {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}) {
    if (type == ignored) return "";  // messages and gradient reduction are stagewise's own
  }
  if (type.size() != 1 || std::string("FIBWR").find(type[0]) == std::string::npos) {
    return "'" + type + "' is not an action type (F, I, B, W, R, or a communication action)";
  }
  if (micro.empty()) return "it has no micro-batch number after '" + type + "'";
  if (p > 9 || micro.size() > 9) return "its numbers are too large";
  out.push_back({std::stoi(s.substr(0, p)), static_cast<ActionKind>(type[0]), std::stoi(micro)});
  return "";
}


// The text's lines, without '\r' (a last line without '\n' included, an empty one not).
inline std::vector<std::string> csv_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::string line;
  for (char c : text) {
    if (c == '\n') {
      lines.push_back(line);
      line.clear();
    } else if (c != '\r') {
      line += c;
    }
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

// Parses the cell in row r (from 0) and `column` (from 1), an action or an (a;b)OVERLAP_F_B
// group, into `row`; fails naming the cell.
inline void csv_cell(const std::string& cell, std::size_t r, std::size_t column,
                     std::vector<Action>& row) {
  auto fail = [&](const std::string& why) {
    TORCH_CHECK(false, "stagewise::schedule::from_csv: row ", r + 1, " (rank ", r, "), column ",
                column, ": '", cell, "' is not an action: ", why,
                "; write <stage><F|I|B|W><micro-batch>, e.g. 0F1 for the forward of "
                "micro-batch 1 on stage 0");
  };
  if (cell.front() != '(') {
    if (const auto why = csv_action(cell, row); !why.empty()) fail(why);
    return;
  }
  const auto close = cell.find(')');
  if (close == std::string::npos || cell.substr(close + 1) != "OVERLAP_F_B") {
    fail("a group of actions is written (a;b)OVERLAP_F_B");
  }
  std::size_t s = 1;
  while (s < close) {
    const std::size_t semi = std::min(cell.find(';', s), close);
    const auto why = csv_action(csv_trim(cell.substr(s, semi - s)), row);
    if (!why.empty()) fail(why);
    s = semi + 1;
  }
}

// Records that row r runs `a`'s stage (`rank_of`: per stage, its row or -1); fails when another
// row already does.
inline void csv_place(const Action& a, const std::string& cell, std::size_t r, std::size_t column,
                      std::vector<int>& rank_of) {
  if (a.stage >= static_cast<int>(rank_of.size())) {
    rank_of.resize(static_cast<std::size_t>(a.stage) + 1, -1);
  }
  int& rank = rank_of[static_cast<std::size_t>(a.stage)];
  TORCH_CHECK(rank == -1 || rank == static_cast<int>(r), "stagewise::schedule::from_csv: row ",
              r + 1, " (rank ", r, "), column ", column, ": '", cell, "' runs stage ", a.stage,
              ", whose actions are on rank ", rank, " (row ", rank + 1,
              "); a stage lives on one rank, so put all its actions in one row");
  rank = static_cast<int>(r);
}

}  // namespace detail

/// Reads a schedule in the CSV format of PyTorch's torch.distributed.pipelining
/// (`_dump_csv` / `_load_csv`, "compute_only"): one row per rank, each cell one action
/// `<stage><type><micro-batch>`: `0F1` forward of micro-batch 1 on stage 0, `2I0` its input
/// gradient, `1W3` its weight gradient, `0B2` a full backward; an empty cell is an idle step.
/// Also read: `(0F4;1B2)OVERLAP_F_B` (the pair runs in that order), `R` for a recompute placed
/// by the schedule (stagewise's own), and communication or sharding actions (`1SEND_F0`,
/// `0RECV_B1`, `UNSHARD`, `RESHARD`, `REDUCE_GRAD`), which are skipped because stagewise sends
/// messages itself. A malformed cell is an error naming its row and column (both from 1).
///   auto s = stagewise::schedule::from_csv(text);
///   stagewise::schedule::verify(s, s.stages, s.micro_batches);
inline csv_schedule from_csv(const std::string& text) {
  csv_schedule out;
  const std::vector<std::string> lines = detail::csv_lines(text);
  TORCH_CHECK(!lines.empty(),
              "stagewise::schedule::from_csv: the text has no rows; give one row "
              "of actions per rank, e.g. \"0F0,0B0\"");
  std::vector<int> rank_of;  // per stage, -1 until seen
  for (std::size_t r = 0; r < lines.size(); ++r) {
    std::vector<Action> row;
    std::size_t column = 0;
    std::size_t start = 0;
    while (start <= lines[r].size()) {
      const std::size_t comma = std::min(lines[r].find(',', start), lines[r].size());
      const std::string cell = detail::csv_trim(lines[r].substr(start, comma - start));
      ++column;
      start = comma + 1;
      if (cell.empty()) continue;
      const std::size_t before = row.size();
      detail::csv_cell(cell, r, column, row);
      for (std::size_t k = before; k < row.size(); ++k) {
        detail::csv_place(row[k], cell, r, column, rank_of);
        out.micro_batches = std::max(out.micro_batches, row[k].micro + 1);
      }
    }
    out.ranks.push_back(std::move(row));
  }
  out.stages = static_cast<int>(rank_of.size());
  for (std::size_t s = 0; s < rank_of.size(); ++s) {
    TORCH_CHECK(rank_of[s] >= 0, "stagewise::schedule::from_csv: stage ", s,
                " appears in no row, but stage ", rank_of.size() - 1,
                " does; number the stages 0..", rank_of.size() - 1, " without gaps");
  }
  for (std::size_t r = 0; r < out.ranks.size(); ++r) {
    TORCH_CHECK(!out.ranks[r].empty(), "stagewise::schedule::from_csv: row ", r + 1, " (rank ", r,
                ") has no action; give every rank at least one stage's actions, or drop the row");
  }
  out.placement = std::move(rank_of);
  return out;
}

/// Writes a plan in PyTorch's CSV format ("compute_only", see `from_csv`): one row per worker,
/// one column per step of a clock on which every action takes one step, an empty cell where the
/// worker waits, as PyTorch's `_dump_csv` lays out its schedules. Recomputes are left out unless
/// `recomputes` is true (PyTorch has no recompute action; `from_csv` reads them back).
///   std::string text = stagewise::schedule::to_csv(stagewise::schedule::plan(one_f_one_b{}, 2,
///   2));
///   // "0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1\n"
inline std::string to_csv(const Plan& plan, bool recomputes = false) {
  std::vector<std::vector<Action>> programs = plan.programs;
  for (auto& p : programs) {  // PyTorch's grammar has no offload or reload either
    p.erase(std::remove_if(p.begin(), p.end(),
                           [&](const Action& a) {
                             return is_copy(a.kind) ||
                                    (!recomputes && a.kind == ActionKind::recompute);
                           }),
            p.end());
  }
  detail::Dependencies deps(plan.stages, plan.micro_batches);
  const auto r = detail::replay(programs, deps, [](const Action&) { return 1.0; });
  TORCH_CHECK(r.complete,
              "stagewise::schedule::to_csv: the plan deadlocks; build it with "
              "stagewise::schedule::plan, which verifies the schedule");
  std::vector<std::vector<std::string>> cells(programs.size());
  for (const auto& t : r.timed) {
    auto& row = cells[static_cast<std::size_t>(t.worker)];
    const auto step = static_cast<std::size_t>(t.start);
    if (row.size() <= step) row.resize(step + 1);
    const Action& a = t.action;
    row[step] = std::to_string(a.stage) + static_cast<char>(a.kind) + std::to_string(a.micro);
  }
  std::string out;
  for (const auto& row : cells) {
    for (std::size_t c = 0; c < row.size(); ++c) out += (c ? "," : "") + row[c];
    out += '\n';
  }
  return out;
}

}  // namespace stagewise::schedule
