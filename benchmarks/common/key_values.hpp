#pragma once

// Reading `key=value` lines printed by an anchor program (a Python script run beside a C++
// benchmark), and finding a Python whose PyTorch has a given module.

#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <string>

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

}  // namespace stagewise::bench
