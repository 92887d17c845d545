#pragma once

// `--blas=openblas` (or STAGEWISE_BLAS=openblas): run a benchmark against OpenBLAS without
// touching the system. Debian's OpenBLAS package is fetched once into a cache directory
// (`apt-get download` + `dpkg -x`; the system's BLAS alternative stays as it is) and the program
// re-executes itself with LD_LIBRARY_PATH pointing there.

#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/files.hpp"

#include <c10/util/Exception.h>

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

namespace stagewise::bench {

/// The directory OpenBLAS is unpacked into: $STAGEWISE_CACHE/openblas, else
/// $XDG_CACHE_HOME/stagewise/openblas, else ~/.cache/stagewise/openblas.
inline std::string openblas_cache_dir() {
  if (const char* dir = std::getenv("STAGEWISE_CACHE")) return files::join(dir, "openblas");
  if (const char* dir = std::getenv("XDG_CACHE_HOME")) {
    return files::join(dir, "stagewise/openblas");
  }
  const char* home = std::getenv("HOME");
  return files::join(home ? home : "/tmp", ".cache/stagewise/openblas");
}

/// The directory under `root` that holds OpenBLAS's `libblas.so.3` (Debian's
/// usr/lib/<triplet>/openblas-pthread), or an empty string when it is not unpacked there.
inline std::string find_openblas_libdir(const std::string& root) {
  const auto lib = files::join(root, "usr/lib");
  for (const auto& triplet : files::list(lib)) {
    const auto dir = files::join(files::join(lib, triplet), "openblas-pthread");
    if (files::exists(files::join(dir, "libblas.so.3"))) return dir;
  }
  return {};
}

/// Fetches Debian's libopenblas0-pthread into `root` unless it is there already, and returns the
/// library directory. Needs `apt-get` and `dpkg` (and a current package list).
inline std::string fetch_openblas(const std::string& root) {
  if (auto dir = find_openblas_libdir(root); !dir.empty()) return dir;
  const auto download = files::join(root, "download");
  files::make_directories(download);
  const std::string command = "cd '" + download +
                              "' && apt-get download libopenblas0-pthread >/dev/null 2>&1"
                              " && dpkg -x libopenblas0-pthread_*.deb '" +
                              root + "'";
  const int rc = std::system(command.c_str());
  auto dir = find_openblas_libdir(root);
  TORCH_CHECK(rc == 0 && !dir.empty(), "--blas=openblas: fetching OpenBLAS into ", root,
              " failed (`", command, "` exited with ", rc,
              "). Run `apt-get update` so that apt knows the package, or unpack "
              "libopenblas0-pthread's .deb there yourself with `dpkg -x PACKAGE.deb ",
              root, "`.");
  return dir;
}

/// Selects the BLAS for this run from `--blas=openblas|system` (or STAGEWISE_BLAS; the flag
/// wins). For "openblas" it fetches OpenBLAS if needed and re-executes the program with
/// LD_LIBRARY_PATH pointing at it, OPENBLAS_NUM_THREADS=1 (one BLAS thread per worker) and
/// OPENBLAS_THREAD_TIMEOUT=4 (set either yourself to change it); after the re-execution it checks
/// that OpenBLAS is what got loaded. The timeout matters for fair comparisons: by default an idle
/// OpenBLAS thread spins for 2^28 cycles (about 0.1 s) after each multi-threaded call, so a
/// variant that runs after a "2 BLAS threads" variant would share its cores with a spinning
/// thread; with 4 (2^4 cycles, OpenBLAS's minimum) idle threads sleep at once. Call it first
/// thing in main, before any LibTorch work. Returns the selected name.
///   int main(int argc, char** argv) { select_blas(argc, argv); ... }
inline std::string select_blas(int argc, char** argv) {
  std::string mode;
  if (const char* env = std::getenv("STAGEWISE_BLAS")) mode = env;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--blas=", 7) == 0) mode = argv[i] + 7;
  }
  if (mode.empty() || mode == "system") return "system";
  TORCH_CHECK(mode == "openblas", "unknown BLAS '", mode,
              "' (from --blas= or STAGEWISE_BLAS): write --blas=openblas to fetch and use "
              "OpenBLAS, or --blas=system for the library the system selects");
  if (std::getenv("STAGEWISE_BLAS_REEXECUTED") != nullptr) {
    TORCH_CHECK(loaded_blas().find("openblas:") != std::string::npos,
                "--blas=openblas: re-executed with LD_LIBRARY_PATH=",
                std::getenv("LD_LIBRARY_PATH") ? std::getenv("LD_LIBRARY_PATH") : "",
                " but the BLAS loaded is ", loaded_blas(), ". Delete the cache directory ",
                openblas_cache_dir(), " so that it is fetched again.");
    return "openblas";
  }
  const auto dir = fetch_openblas(openblas_cache_dir());
  std::string path = dir;
  if (const char* old = std::getenv("LD_LIBRARY_PATH"); old && *old) path += ":" + std::string(old);
  setenv("LD_LIBRARY_PATH", path.c_str(), 1);
  setenv("OPENBLAS_NUM_THREADS", "1", 0);
  setenv("OPENBLAS_THREAD_TIMEOUT", "4", 0);
  setenv("STAGEWISE_BLAS_REEXECUTED", "1", 1);
  std::fflush(nullptr);
  execv("/proc/self/exe", argv);
  TORCH_CHECK(false, "--blas=openblas: re-executing /proc/self/exe failed (", std::strerror(errno),
              "); run the program with LD_LIBRARY_PATH=", dir, " instead");
  return "openblas";
}

/// Sets the number of threads OpenBLAS itself uses, when OpenBLAS is loaded (LibTorch's
/// at::set_num_threads does not reach OpenBLAS's pthread build); returns false, doing nothing,
/// when another BLAS is loaded. A whole-batch baseline "on 2 threads" calls it with 2.
///   at::set_num_threads(2); set_blas_threads(2); step(); set_blas_threads(1);
///   at::set_num_threads(1);
inline bool set_blas_threads(int n) {
  using SetThreads = void (*)(int);
  auto* set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set == nullptr) return false;
  set(n);
  return true;
}

}  // namespace stagewise::bench
