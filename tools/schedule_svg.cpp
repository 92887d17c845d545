// schedule_svg: simulates a pipeline schedule and draws its timeline as an SVG picture.
//   schedule_svg --schedule=one_f_one_b --stages=4 --micro=8 [--virtual=2] [--costs=1,1,1]
//                [--checkpointed=0] [--offload=COPY] [--title=TEXT] --out=file.svg
// --offload=COPY places offloads and reloads (schedule::offload) with copies of that time, for the
// checkpointed micro-batches of gpipe, one_f_one_b and zero_bubble_h1.
// --stages is the number of workers K. With --schedule=interleaved_one_f_one_b or looped_bfs and
// --virtual=v the model is cut into v x K stages, each costing 1/v of a whole stage; the
// V-shaped zero_bubble_v, dualpipe_v, v_half and v_min always cut it into 2K stages (two per
// worker, costing 1/2 each), so pictures of different schedules show the same model. --costs are
// T_F, T_B (input-gradient part) and T_W. Prints the makespan, the bubble and the peak
// micro-batches in flight.
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/svg.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/v_min.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>

namespace sched = stagewise::schedule;

namespace {

int usage(const std::string& problem) {
  std::fprintf(
      stderr,
      "schedule_svg: %s\n"
      "usage: schedule_svg --schedule=gpipe|one_f_one_b|interleaved_one_f_one_b|looped_bfs|\n"
      "                               zero_bubble_h1|zero_bubble_v|dualpipe_v|v_half|v_min\n"
      "                    --stages=K --micro=M [--virtual=v] [--costs=F,B,W] [--checkpointed=n]\n"
      "                    [--offload=COPY] [--title=TEXT] --out=FILE.svg\n",
      problem.c_str());
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
  if (v != 1 && name != "interleaved_one_f_one_b" && name != "looped_bfs")
    return usage("--virtual applies to interleaved_one_f_one_b and looped_bfs only");
  try {
    sched::Simulation sim;
    std::string label;
    if (name == "gpipe") {
      sim = sched::simulate(sched::gpipe{}, k, m, costs, checkpointed);
      label = "GPipe";
    } else if (name == "one_f_one_b") {
      sim = sched::simulate(sched::one_f_one_b{}, k, m, costs, checkpointed);
      label = "1F1B";
    } else if (name == "interleaved_one_f_one_b") {
      sched::Costs part{costs.forward / v, costs.input_grad / v, costs.weight_grad / v, -1.0};
      sim = sched::simulate(sched::interleaved_one_f_one_b{v}, k * v, m, part, checkpointed);
      label = "interleaved 1F1B, v=" + std::to_string(v);
    } else if (name == "looped_bfs") {
      sched::Costs part{costs.forward / v, costs.input_grad / v, costs.weight_grad / v, -1.0};
      sim = sched::simulate(sched::looped_bfs{v}, k * v, m, part, checkpointed);
      label = "looped BFS, v=" + std::to_string(v);
    } else if (name == "zero_bubble_v" || name == "dualpipe_v" || name == "v_half" ||
               name == "v_min") {
      sched::Costs half{costs.forward / 2, costs.input_grad / 2, costs.weight_grad / 2, -1.0};
      if (name == "zero_bubble_v") {
        sim = sched::simulate(sched::zero_bubble_v{}, 2 * k, m, half, checkpointed);
        label = "ZB-V";
      } else if (name == "v_half") {
        sim = sched::simulate(sched::v_half{}, 2 * k, m, half, checkpointed);
        label = "V-Half";
      } else if (name == "v_min") {
        sim = sched::simulate(sched::v_min{}, 2 * k, m, half, checkpointed);
        label = "V-Min";
      } else {
        sim = sched::simulate(sched::dualpipe_v{}, 2 * k, m, half, checkpointed);
        label = "DualPipeV";
      }
    } else if (name == "zero_bubble_h1") {
      sim = sched::simulate(sched::zero_bubble_h1{}, k, m, costs, checkpointed);
      label = "ZB-H1";
    } else {
      return usage("unknown schedule '" + name + "'");
    }
    if (args.count("offload")) {
      // Offloads placed by schedule::offload, copies of the given time (one stage per worker).
      costs.offload = std::stod(args["offload"]);
      sched::Plan p;
      if (name == "gpipe")
        p = sched::plan(sched::gpipe{}, k, m, checkpointed);
      else if (name == "one_f_one_b")
        p = sched::plan(sched::one_f_one_b{}, k, m, checkpointed);
      else if (name == "zero_bubble_h1")
        p = sched::plan(sched::zero_bubble_h1{}, k, m, checkpointed);
      else
        return usage("--offload applies to gpipe, one_f_one_b and zero_bubble_h1");
      sim = sched::simulate(sched::offload(p, {.costs = costs}), costs);
      label += ", offload";
    }
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
