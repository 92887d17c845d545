#pragma once

// Reading `key=value` lines printed by an anchor program (a Python script run beside a C++
// benchmark), and finding a Python whose PyTorch has a given module.

#include "benchmarks/common/files.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace stagewise::bench {

/// Runs `command` through the shell and collects every `key=number` line of its standard output;
/// lines that are not of that form are ignored (a value of "nan" reads as NaN).
///   auto anchor = run_key_values("/usr/bin/python3 benchmarks/anchors/torch_pipe.py");
///   double us = value_or_nan(anchor, "b_pipe_us");
inline std::map<std::string, double> run_key_values(const std::string& command) {
  std::map<std::string, double> out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return out;
  char line[512];
  while (std::fgets(line, sizeof line, p)) {
    const std::string s(line);
    const auto eq = s.find('=');
    if (eq == std::string::npos || s.find(' ') < eq) continue;
    try {
      out[s.substr(0, eq)] = std::stod(s.substr(eq + 1));
    } catch (...) {
      // a non-numeric value (a version string, a word): not a figure
    }
  }
  pclose(p);
  return out;
}

/// The value of `key`, or NaN when the anchor did not print it.
inline double value_or_nan(const std::map<std::string, double>& values, const std::string& key) {
  const auto it = values.find(key);
  return it == values.end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
}

/// The command prefix that runs a program inside the Debian root `dir`: holding the root's lock
/// file, if it has one, so that whoever maintains the root does not tear it down (and end the
/// anchor's processes) meanwhile; with USE_LIBUV=0, and LD_LIBRARY_PATH set to `library_path`
/// (a path inside the root), or unset when that is empty (the host's paths mean nothing there).
inline std::string chroot_command(const std::string& dir, const std::string& library_path = "") {
  const auto lock = dir + ".lock";
  const std::string locked = files::exists(lock) ? "flock -w 600 '" + lock + "' " : std::string();
  const std::string library =
      library_path.empty() ? "-u LD_LIBRARY_PATH" : "LD_LIBRARY_PATH=" + library_path;
  return locked + "chroot '" + dir + "' env " + library + " USE_LIBUV=0 ";
}

/// A Python that has `module` (e.g. torch.distributed.pipelining): "python3 " if the system's has
/// it, else "chroot DIR python3 " for a Debian root under /var/cache/stagewise (or
/// $STAGEWISE_PYTHON_ROOT) that has it; "" if none. `root` receives DIR ("" for the system).
inline std::string python_with(const std::string& module, std::string& root) {
  const std::string probe = " -c 'import " + module + "' >/dev/null 2>&1";
  root.clear();
  if (std::system(("/usr/bin/python3" + probe).c_str()) == 0) return "/usr/bin/python3 ";
  std::vector<std::string> candidates;
  if (const char* dir = std::getenv("STAGEWISE_PYTHON_ROOT")) candidates.emplace_back(dir);
  for (const auto& name : files::list("/var/cache/stagewise")) {
    candidates.push_back(files::join("/var/cache/stagewise", name));
  }
  for (const auto& dir : candidates) {
    if (!files::exists(files::join(dir, "usr/bin/python3"))) continue;
    const std::string chroot = chroot_command(dir);
    if (std::system((chroot + "python3" + probe).c_str()) == 0) {
      root = dir;
      return chroot + "python3 ";
    }
  }
  return "";
}

/// The first directory of LD_LIBRARY_PATH that holds an OpenBLAS `libblas.so.3` (what
/// `--blas=openblas` puts there), or an empty string.
inline std::string openblas_dir_in_library_path() {
  const char* path = std::getenv("LD_LIBRARY_PATH");
  std::string rest = path ? path : "";
  while (!rest.empty()) {
    const auto colon = rest.find(':');
    const std::string dir = rest.substr(0, colon);
    rest = colon == std::string::npos ? "" : rest.substr(colon + 1);
    if (dir.find("openblas") != std::string::npos &&
        files::exists(files::join(dir, "libblas.so.3"))) {
      return dir;
    }
  }
  return {};
}

/// Runs an anchor script with the Python found for `module`; inside a chroot the script and
/// anchor_common.py are copied to the root's /tmp/stagewise_anchors first. Empty when no such
/// Python exists. The script runs under `timeout 600`. When this process multiplies with
/// OpenBLAS through LD_LIBRARY_PATH (`--blas=openblas`), so does the anchor: the system's Python
/// inherits the variable, and for a chroot the library is copied to the root's
/// /tmp/stagewise_openblas and named there (else the anchor's PyTorch would use the root's own
/// BLAS and the two sides would compare different matrix-product libraries).
inline std::map<std::string, double> run_anchor(const std::string& script,
                                                const std::string& module,
                                                const std::string& args) {
  std::string root;
  std::string python = python_with(module, root);
  if (python.empty()) return {};
  std::string path = script;
  if (!root.empty()) {
    // The script and the helpers it imports, into the root's /tmp.
    const std::string inside = "/tmp/stagewise_anchors";
    const std::string target = root + inside;
    files::make_directories(target);
    for (const auto& name : {files::filename(script), std::string("anchor_common.py")}) {
      if (!files::copy_file(files::join(files::parent(script), name), files::join(target, name))) {
        return {};
      }
    }
    path = files::join(inside, files::filename(script));
    if (const auto openblas = openblas_dir_in_library_path(); !openblas.empty()) {
      const std::string blas = "/tmp/stagewise_openblas";
      const std::string blas_target = root + blas;
      files::make_directories(blas_target);
      for (const auto& name : files::list(openblas)) {
        const auto from = files::join(openblas, name);
        const auto to = files::join(blas_target, name);
        bool ok = true;
        if (files::is_symlink(from)) {  // libopenblas.so.0 -> the library: a link, not a copy
          if (!files::is_symlink(to)) ok = files::copy_symlink(from, to);
        } else {
          ok = files::copy_file(from, to, /*only_if_newer=*/true);
        }
        if (!ok) return {};
      }
      python = chroot_command(root, blas) + "python3 ";
    }
  }
  return run_key_values("timeout 600 " + python + path + " " + args + " 2>/dev/null");
}

}  // namespace stagewise::bench
