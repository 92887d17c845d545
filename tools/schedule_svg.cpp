// schedule_svg: simulates a pipeline schedule and draws its timeline as an SVG picture.
//   schedule_svg --schedule=one_f_one_b --stages=4 --micro=8 [--virtual=2] [--costs=1,1,1]
//                [--checkpointed=0] [--offload=COPY] [--title=TEXT] --out=file.svg
// --schedule names a built-in (schedule/builtins.hpp: the list this tool iterates).
// --offload=COPY places offloads and reloads (schedule::offload) with copies of that time, for the
// checkpointed micro-batches of the schedules with one stage per worker (gpipe, one_f_one_b and
// zero_bubble_h1).
// --stages is the number of workers K. With a schedule that takes virtual stages
// (interleaved_one_f_one_b, looped_bfs) and --virtual=v the model is cut into v x K stages, each
// costing 1/v of a whole stage; the V-shaped zero_bubble_v, dualpipe_v, v_half and v_min always
// cut it into 2K stages (two per worker, costing 1/2 each), so pictures of different schedules
// show the same model. --costs are T_F, T_B (input-gradient part) and T_W. Prints the makespan,
// the bubble and the peak micro-batches in flight.
#include "stagewise/schedule/builtins.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/svg.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace sched = stagewise::schedule;

namespace {

// "a, b and c"
std::string listing(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  }
  return out;
}

// The built-ins' names: all of them, those that take --virtual, and those --offload applies to
// (one stage per worker).
struct Names {
  std::vector<std::string> all, virtual_stages, offload;
};

Names builtin_names() {
  Names out;
  sched::for_each_schedule([&](auto s) {
    out.all.emplace_back(s.name);
    if constexpr (requires { s.virtual_stages; }) {
      out.virtual_stages.emplace_back(s.name);
    } else if (sched::stages_per_worker_of(s) == 1) {
      out.offload.emplace_back(s.name);
    }
  });
  return out;
}

int usage(const std::string& problem) {
  std::string schedules;
  for (const auto& n : builtin_names().all) schedules += (schedules.empty() ? "" : "|") + n;
  std::fprintf(stderr,
               "schedule_svg: %s\n"
               "usage: schedule_svg --schedule=%s\n"
               "                    --stages=K --micro=M [--virtual=v] [--costs=F,B,W] "
               "[--checkpointed=n]\n"
               "                    [--offload=COPY] [--title=TEXT] --out=FILE.svg\n",
               problem.c_str(), schedules.c_str());
  return 2;
}

bool parse_int(const std::string& s, int& out) {
  try {
    std::size_t used = 0;
    out = std::stoi(s, &used);
    return used == s.size();
  } catch (...) {
    return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args{
      {"virtual", "1"}, {"costs", "1,1,1"}, {"checkpointed", "0"}};
  for (int k = 1; k < argc; ++k) {
    const std::string a = argv[k];
    const auto eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos)
      return usage("expected --name=value, got '" + a + "'");
    args[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  for (const char* needed : {"schedule", "stages", "micro", "out"}) {
    if (!args.count(needed)) return usage(std::string("--") + needed + " is missing");
  }
  int k = 0;
  int m = 0;
  int v = 1;
  int checkpointed = 0;
  if (!parse_int(args["stages"], k) || k < 1) return usage("--stages must be a positive integer");
  if (!parse_int(args["micro"], m) || m < 1) return usage("--micro must be a positive integer");
  if (!parse_int(args["virtual"], v) || v < 1) return usage("--virtual must be a positive integer");
  if (!parse_int(args["checkpointed"], checkpointed) || checkpointed < 0) {
    return usage("--checkpointed must be 0 or more");
  }
  sched::Costs costs;
  {
    std::istringstream in(args["costs"]);
    char c1 = 0;
    char c2 = 0;
    if (!(in >> costs.forward >> c1 >> costs.input_grad >> c2 >> costs.weight_grad) || c1 != ',' ||
        c2 != ',') {
      return usage("--costs must be three numbers T_F,T_B,T_W, e.g. 1,1,1");
    }
  }
  const std::string name = args["schedule"];
  const Names names = builtin_names();
  const auto is = [&](const std::vector<std::string>& list) {
    return std::find(list.begin(), list.end(), name) != list.end();
  };
  if (v != 1 && !is(names.virtual_stages))
    return usage("--virtual applies to " + listing(names.virtual_stages) + " only");
  if (!is(names.all)) return usage("unknown schedule '" + name + "'");
  if (args.count("offload") && !is(names.offload))
    return usage("--offload applies to " + listing(names.offload));
  try {
    sched::Simulation sim;
    std::string label;
    sched::for_each_schedule([&](auto s) {
      if (s.name != name) return;
      if constexpr (requires { s.virtual_stages; }) s.virtual_stages = v;
      const int per_worker = sched::stages_per_worker_of(s);
      label = sched::title_of(s);
      if constexpr (requires { s.virtual_stages; }) label += ", v=" + std::to_string(v);
      if (args.count("offload")) {
        // Offloads placed by schedule::offload, copies of the given time (one stage per worker).
        costs.offload = std::stod(args["offload"]);
        const auto p = sched::plan(s, k, m, checkpointed);
        sim = sched::simulate(sched::offload(p, {.costs = costs}), costs);
        label += ", offload";
        return;
      }
      // Each of a worker's stages costs its share of the worker's whole model.
      const sched::Costs part{costs.forward / per_worker, costs.input_grad / per_worker,
                              costs.weight_grad / per_worker, -1.0};
      sim = sched::simulate(s, k * per_worker, m, part, checkpointed);
    });
    std::string title = args.count("title") ? args["title"]
                                            : label + ": " + std::to_string(k) + " workers, " +
                                                  std::to_string(m) + " micro-batches";
    sched::write_svg(sim.timeline, args["out"], {.title = title});
    std::printf(
        "schedule_svg %s stages=%d micro=%d virtual=%d actions=%zu makespan=%.3f bubble=%.4f "
        "peak_in_flight=%d worker_peak=%d\n",
        name.c_str(), k, m, v, sim.timeline.actions.size(), sim.makespan(), sim.bubble(),
        sim.max_in_flight(),
        *std::max_element(sim.worker_peak_in_flight.begin(), sim.worker_peak_in_flight.end()));
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "schedule_svg: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
