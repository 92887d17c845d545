#include "benchmarks/common/rounds.hpp"
#include "benchmarks/common/blas.hpp"
#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/cpu_time.hpp"
#include "benchmarks/common/files.hpp"
#include "benchmarks/common/stats.hpp"

#include <ATen/Context.h>
#include <torch/types.h>

#include <doctest/doctest.h>

#include "tests/support/errors.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace bench = stagewise::bench;
using stagewise::testing::contains;
using stagewise::testing::error_of;

TEST_SUITE("benchmark machinery") {
  TEST_CASE("a summary holds the minimum, the median and the maximum") {
    const auto odd = bench::summarize({5.0, 1.0, 3.0});
    CHECK(odd.min == 1.0);
    CHECK(odd.median == 3.0);
    CHECK(odd.max == 5.0);
    CHECK(bench::summarize({4.0, 1.0, 2.0, 3.0}).median == 2.5);
    CHECK(std::isnan(bench::summarize({}).median));
  }

  TEST_CASE("rounds alternate the variants, starting one later each round") {
    std::vector<char> order;
    bench::Rounds rounds(/*rounds=*/3, /*calls=*/1, /*warmup=*/0);
    rounds.add("a", [&] { order.push_back('a'); });
    rounds.add("b", [&] { order.push_back('b'); });
    rounds.add("c", [&] { order.push_back('c'); });
    rounds.run();
    CHECK(std::string(order.begin(), order.end()) == "abcbcacab");
    CHECK(rounds.wall_samples("a").size() == 3);
    CHECK(rounds.cpu_samples("c").size() == 3);
  }

  TEST_CASE("warm-up calls run first and are not timed") {
    int calls = 0;
    bench::Rounds rounds(/*rounds=*/2, /*calls=*/3, /*warmup=*/2);
    rounds.add("x", [&] { ++calls; });
    rounds.run();
    CHECK(calls == 2 + 2 * 3);
    CHECK(rounds.wall_samples("x").size() == 2);
  }

  TEST_CASE("ratios are taken within each round") {
    bench::Rounds rounds(/*rounds=*/3, /*calls=*/1, /*warmup=*/0);
    rounds.add("slow", [] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
    rounds.add("fast", [] { std::this_thread::sleep_for(std::chrono::milliseconds(5)); });
    rounds.run();
    const auto ratio = rounds.wall_ratio("slow", "fast");
    CHECK(ratio.min > 1.5);  // sleeping costs no CPU but takes at least its time
    const auto& slow = rounds.wall_samples("slow");
    const auto& fast = rounds.wall_samples("fast");
    std::vector<double> by_round;
    for (int r = 0; r < 3; ++r) by_round.push_back(slow[r] / fast[r]);
    CHECK(ratio.median == bench::summarize(by_round).median);
    CHECK(rounds.cpu("slow").median < 15000);  // 20 ms asleep is not 20 ms of CPU
  }

  TEST_CASE("process CPU time counts every thread") {
    const double t0 = bench::process_cpu_us();
    auto spin = [] {
      const double start = bench::thread_cpu_us();
      while (bench::thread_cpu_us() - start < 20000) {
      }
    };
    std::thread a(spin), b(spin);
    a.join();
    b.join();
    CHECK(bench::process_cpu_us() - t0 >= 40000);
  }

  TEST_CASE("pinning moves every thread to one core and restores the mask after") {
    cpu_set_t before;
    sched_getaffinity(0, sizeof before, &before);
    {
      bench::PinnedToOneCore pin;
      cpu_set_t now;
      sched_getaffinity(0, sizeof now, &now);
      CHECK(CPU_COUNT(&now) == 1);
      CHECK(CPU_ISSET(pin.core(), &now));
    }
    cpu_set_t after;
    sched_getaffinity(0, sizeof after, &after);
    CHECK(CPU_EQUAL(&before, &after));
  }

  TEST_CASE("asking for an unknown variant names the fix") {
    bench::Rounds rounds(1);
    CHECK(contains(error_of([&] { rounds.wall("missing"); }),
                   "no variant named 'missing'; add it with add(name, fn) before asking for it"));
  }

  TEST_CASE("BLAS libraries are recognized by their mapped path") {
    CHECK(bench::blas_kind("7f r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/openblas-pthread/"
                           "libblas.so.3") == "openblas");
    CHECK(bench::blas_kind("7f r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0") ==
          "reference");
    CHECK(bench::blas_kind("7f r-xp 0 08:01 1 /opt/intel/lib/libmkl_core.so.2") == "mkl");
    CHECK(bench::blas_kind("7f r-xp 0 08:01 1 /usr/lib/libc.so.6") == "");
  }

  TEST_CASE("the BLAS LibTorch multiplies with is a library of its own, mapped in this process") {
    const std::string loaded = bench::loaded_blas();
    if (loaded == "none found" && at::hasMKL()) {
      // Python's torch wheel (and the official LibTorch archives) link MKL into libtorch_cpu.so:
      // no separate BLAS library is mapped, and `blas=` in a benchmark's header says "none found".
      MESSAGE("skipped: this LibTorch has MKL linked into itself, no separate BLAS library to find");
      return;
    }
    CHECK(loaded != "none found");  // Debian's LibTorch multiplies through libblas.so.3
  }

  TEST_CASE("an unknown --blas value names the accepted ones") {
    char prog[] = "bench";
    char flag[] = "--blas=fastest";
    char* argv[] = {prog, flag, nullptr};
    CHECK(contains(error_of([&] { bench::select_blas(2, argv); }),
                   "unknown BLAS 'fastest' (from --blas= or STAGEWISE_BLAS): write "
                   "--blas=openblas"));
    char system[] = "--blas=system";
    char* argv_system[] = {prog, system, nullptr};
    CHECK(bench::select_blas(2, argv_system) == "system");
  }

  TEST_CASE("an unpacked OpenBLAS is found under the cache directory") {
    namespace files = bench::files;
    const auto root = files::join(files::temp_directory(),
                                  "stagewise_rounds_test_blas_" + std::to_string(getpid()));
    REQUIRE(files::remove_tree(root));
    CHECK(bench::find_openblas_libdir(root).empty());
    const auto dir = files::join(root, "usr/lib/x86_64-linux-gnu/openblas-pthread");
    REQUIRE(files::make_directories(dir));
    std::ofstream(files::join(dir, "libblas.so.3")) << "";
    CHECK(bench::find_openblas_libdir(root) == dir);
    CHECK(files::remove_tree(root));
    CHECK(!files::exists(root));
  }

  TEST_CASE("the file helpers copy, list and remove trees without std::filesystem") {
    namespace files = bench::files;
    const auto root = files::join(files::temp_directory(),
                                  "stagewise_files_test_" + std::to_string(getpid()));
    REQUIRE(files::remove_tree(root));
    REQUIRE(files::make_directories(files::join(root, "a/b")));
    CHECK(files::make_directories(files::join(root, "a/b")));  // already there: fine
    std::ofstream(files::join(root, "a/b/x.txt")) << "hello";
    CHECK(files::copy_file(files::join(root, "a/b/x.txt"), files::join(root, "a/y.txt")));
    std::ifstream copied(files::join(root, "a/y.txt"));
    std::string text;
    copied >> text;
    CHECK(text == "hello");
    CHECK(files::copy_symlink(files::join(root, "a/b"), files::join(root, "not_a_link")) == false);
    REQUIRE(symlink("b/x.txt", files::join(root, "a/link").c_str()) == 0);
    CHECK(files::copy_symlink(files::join(root, "a/link"), files::join(root, "a/link2")));
    CHECK(files::is_symlink(files::join(root, "a/link2")));
    CHECK(files::exists(files::join(root, "a/link2")));  // resolves relative to a/
    auto names = files::list(files::join(root, "a"));
    std::sort(names.begin(), names.end());
    CHECK(names == std::vector<std::string>{"b", "link", "link2", "y.txt"});
    CHECK(files::filename("dir/sub/f.py") == "f.py");
    CHECK(files::parent("dir/sub/f.py") == "dir/sub");
    CHECK(files::parent("f.py") == ".");
    CHECK(files::join("a/", "b") == "a/b");
    CHECK(files::remove_tree(root));
    CHECK(!files::exists(root));
    CHECK(files::remove_tree(root));  // nothing to remove: fine
  }
}
