// The offload stores: what goes in comes back, bit for bit, with its dtype and shape; errors name
// the store and the fix. On CUDA (skipped without a GPU): HostStore's copies are ordered by their
// events against a busy compute stream, and its pinned buffers are reused step after step.
#include "stagewise/runtime/file_store.hpp"
#include "stagewise/runtime/host_store.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/runtime/stream.hpp"

#include <torch/cuda.h>
#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {
const bool no_cuda = !torch::cuda::is_available();

std::string fresh_dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(base ? base : "/tmp") + "/stagewise_store_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Puts three tensors (one undefined, one not contiguous, one integer) and takes them back.
void round_trip(sw::runtime::AnyStore store) {
  store.begin_step({0, 2});
  const auto a = torch::randn({5, 7});
  const auto b = torch::randn({6, 4}).t();  // not contiguous
  const auto c = torch::arange(10, torch::kLong);
  for (int micro = 0; micro < 3; ++micro) {
    store.put({2, micro}, {a + micro, torch::Tensor(), b, c});
  }
  for (int micro = 2; micro >= 0; --micro) {
    auto back = store.take({2, micro}, torch::kCPU);
    REQUIRE(back.size() == 4);
    CHECK(back[0].equal(a + micro));
    CHECK_FALSE(back[1].defined());
    CHECK(back[2].equal(b));
    CHECK(back[3].dtype() == torch::kLong);
    CHECK(back[3].equal(c));
  }
  CHECK(contains(error_of([&] {
                   (void)store.take({2, 0}, torch::kCPU);
                 }),
                 "reloads micro-batch 0, which it never offloaded"));
}

// A few milliseconds of products on the current stream of `device`.
void keep_busy(const torch::Device& device) {
  auto a = torch::randn({2048, 2048}, torch::TensorOptions().device(device));
  for (int i = 0; i < 20; ++i) a = torch::mm(a, a).div_(2048.0);
}
}  // namespace

TEST_SUITE("offload stores") {
  TEST_CASE("the file store and the host store give back what was put, bit for bit") {
    round_trip(sw::runtime::FileStore(fresh_dir("round_trip")));
    round_trip(sw::runtime::HostStore());
  }

  TEST_CASE("the file store reuses its file from the start once it is empty") {
    const std::string dir = fresh_dir("reuse");
    sw::runtime::FileStore store(dir);
    store.begin_step({1});
    for (int step = 0; step < 3; ++step) {
      store.put({1, 0}, {torch::ones({1024})});
      CHECK(store.take({1, 0}, torch::kCPU)[0].equal(torch::ones({1024})));
    }
    CHECK(std::filesystem::file_size(store.path_of(1)) == 4096);
  }

  TEST_CASE("a stage the store was not opened for is named") {
    sw::runtime::FileStore store(fresh_dir("unopened"));
    CHECK(contains(error_of([&] {
                     store.put({3, 0}, {torch::ones({2})});
                   }),
                   "stage 3 offloads before the store was opened for it; call begin_step"));
  }

  TEST_CASE(
      "offload_cuda: a copy off a busy compute stream and back is exact, and nothing "
      "reads the reload before it lands" *
      doctest::skip(no_cuda)) {
    const torch::Device gpu(torch::kCUDA, 0);
    sw::runtime::HostStore store;
    const auto compute = sw::runtime::new_stream(gpu);
    c10::StreamGuard on_compute(compute);
    for (int round = 0; round < 10; ++round) {
      store.begin_step({0});
      // Written late on the compute stream; the offload's copy must wait for it.
      keep_busy(gpu);
      auto x =
          torch::full({1 << 24}, static_cast<float>(round), torch::TensorOptions().device(gpu));
      store.put({0, round}, {x});
      x = torch::Tensor();  // its block may be handed out again; only after the copy read it
      auto junk = torch::full({1 << 24}, -1.0f, torch::TensorOptions().device(gpu));
      // The reload's copy runs on another stream; the compute stream reads it at once.
      keep_busy(gpu);
      auto back = store.take({0, round}, gpu);
      CHECK(back[0].eq(static_cast<float>(round)).all().item<bool>());
    }
  }

  TEST_CASE("offload_cuda: pinned buffers are reused step after step" * doctest::skip(no_cuda)) {
    const torch::Device gpu(torch::kCUDA, 0);
    sw::runtime::HostStore store;
    auto step = [&] {
      store.begin_step({0});
      for (int micro = 0; micro < 4; ++micro) {
        store.put({0, micro}, {torch::ones({1 << 20}, torch::TensorOptions().device(gpu))});
      }
      for (int micro = 0; micro < 4; ++micro) (void)store.take({0, micro}, gpu);
      torch::cuda::synchronize();
    };
    step();
    const auto allocations = store.pinned_allocations();
    CHECK(allocations == 4);
    for (int k = 0; k < 3; ++k) step();
    CHECK(store.pinned_allocations() == allocations);
  }
}
