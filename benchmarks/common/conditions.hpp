#pragma once

// The conditions a benchmark ran under, printed in its header: date, cores, load average at start
// and end, LibTorch version, the BLAS library actually loaded, intra-op threads.

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace stagewise::bench {

/// Which BLAS a line of /proc/self/maps names: "openblas", "mkl", "blis", "atlas", "reference"
/// (Netlib, Debian's default `libblas.so.3`) or "" when the line is no BLAS library.
///   blas_kind("7f.. r-xp ... /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3") ==
///   "openblas"
inline std::string blas_kind(const std::string& maps_line) {
  const auto has = [&](const char* s) { return maps_line.find(s) != std::string::npos; };
  if (has("openblas")) return "openblas";
  if (has("libmkl")) return "mkl";
  if (has("blis")) return "blis";
  if (has("atlas")) return "atlas";
  if (has("/libblas.so") || has("/libcblas.so")) return "reference";
  return "";
}

/// The BLAS libraries mapped into this process, from /proc/self/maps: `kind:path` for each
/// distinct library (paths resolved through symlinks), joined by commas; "none found" if none.
///   std::printf("blas=%s\n", loaded_blas().c_str());  //
///   blas=reference:/usr/lib/.../libblas.so.3.11.0
inline std::string loaded_blas() {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> seen;
  std::string line;
  while (std::getline(maps, line)) {
    const std::string kind = blas_kind(line);
    const auto slash = line.find('/');
    if (kind.empty() || slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string item = kind + ":" + path;
    bool known = false;
    for (const auto& s : seen) known = known || s == item;
    if (!known) seen.push_back(item);
  }
  if (seen.empty()) return "none found";
  std::string out;
  for (const auto& s : seen) out += (out.empty() ? "" : ",") + s;
  return out;
}

/// The 1-minute load average now (NaN if the system does not say).
inline double load_average_1min() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : std::numeric_limits<double>::quiet_NaN();
}

/// Records the conditions at construction and prints them as one header line; `print_end()`
/// adds the load average at the end (call it just before the benchmark's last line). The lines
/// start with `# ` so that tools/bench_report can tell them from the results.
///   at::set_num_threads(1);
///   Conditions conditions("pipe_cpu");  // prints "# conditions: benchmark=pipe_cpu date=..."
///   ...
///   conditions.print_end();             // prints "# conditions_end: load_end=..."
class Conditions {
 public:
  /// Prints the header for benchmark `name`; call after setting the intra-op threads.
  explicit Conditions(const std::string& name, std::FILE* out = stdout) : out_(out) {
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    cpu_set_t mask;
    CPU_ZERO(&mask);
    sched_getaffinity(0, sizeof mask, &mask);
    const char* openblas_threads = std::getenv("OPENBLAS_NUM_THREADS");
    const char* openblas_timeout = std::getenv("OPENBLAS_THREAD_TIMEOUT");
    std::fprintf(out_,
                 "# conditions: benchmark=%s date=%s cores=%u usable_cores=%d load_start=%.2f "
                 "libtorch=%d.%d.%d blas=%s intra_op_threads=%d openblas_num_threads=%s "
                 "openblas_thread_timeout=%s\n",
                 name.c_str(), date, std::thread::hardware_concurrency(), CPU_COUNT(&mask),
                 load_average_1min(), TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH,
                 loaded_blas().c_str(), at::get_num_threads(),
                 openblas_threads ? openblas_threads : "unset",
                 openblas_timeout ? openblas_timeout : "unset");
  }

  /// Prints the load average at the end.
  void print_end() const {
    std::fprintf(out_, "# conditions_end: load_end=%.2f\n", load_average_1min());
  }

 private:
  std::FILE* out_;
};

}  // namespace stagewise::bench
