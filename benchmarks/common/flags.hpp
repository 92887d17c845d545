#pragma once

// Command-line flags of the benchmark programs: `--name` alone, `--name=N` or `--name=S`.
#include <cstdlib>
#include <cstring>
#include <string>

namespace stagewise::bench {

// Whether `flag` (e.g. "--overhead-only") is among the arguments.
inline bool has_flag(int argc, char** argv, const std::string& flag) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i] == flag) return true;
  }
  return false;
}

// N of `name=N` (e.g. "--rounds"), else `fallback`.
inline int int_flag(int argc, char** argv, const char* name, int fallback) {
  const std::string prefix = std::string(name) + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0)
      return std::atoi(argv[i] + prefix.size());
  }
  return fallback;
}

// S of `name=S` (e.g. "--profile"), else "".
inline std::string string_flag(int argc, char** argv, const char* name) {
  const std::string prefix = std::string(name) + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) return argv[i] + prefix.size();
  }
  return "";
}

}  // namespace stagewise::bench
