// The offload stores: what goes in comes back, bit for bit, with its dtype and shape; errors name
// the store and the fix. On CUDA (skipped without a GPU): HostStore's copies are ordered by their
// events against a stalled compute stream, the same copies without the events are shown to read
// the data before it is there (so the first test fails without them), and its pinned buffers are
// reused step after step.
#include "stagewise/runtime/file_store.hpp"
#include "stagewise/runtime/host_store.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/runtime/stream.hpp"

#if defined(STAGEWISE_WITH_CUDA)
#include <ATen/cuda/Sleep.h>
#endif
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
#if defined(STAGEWISE_WITH_CUDA)
constexpr bool kCanStall = true;
#else
constexpr bool kCanStall = false;  // no at::cuda::sleep: only busy work, which may be too short
#endif

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

// Holds the current stream of `device` for tens of milliseconds: what is queued on it next runs
// that much later, while other streams go on. (at::cuda::sleep spins a kernel for a number of
// cycles: 2^27 is about 70 ms at 2 GHz. Without it, a few milliseconds of products.)
void stall(const torch::Device& device) {
#if defined(STAGEWISE_WITH_CUDA)
  (void)device;
  at::cuda::sleep(int64_t{1} << 27);
#else
  auto a = torch::randn({2048, 2048}, torch::TensorOptions().device(device));
  for (int i = 0; i < 20; ++i) a = torch::mm(a, a).div_(2048.0);
#endif
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
      // Written late on the compute stream; the offload's copy must wait for it (its event), and
      // the reload's copy for the offload's (its event), and the read below for the reload (its
      // event): with any one of them missing the check fails, as the next test shows.
      stall(gpu);
      auto x =
          torch::full({1 << 24}, static_cast<float>(round), torch::TensorOptions().device(gpu));
      store.put({0, round}, {x});
      x = torch::Tensor();  // its block may be handed out again; only after the copy read it
      auto junk = torch::full({1 << 24}, -1.0f, torch::TensorOptions().device(gpu));
      // The reload's copy runs on another stream; the compute stream reads it at once.
      auto back = store.take({0, round}, gpu);
      CHECK(back[0].eq(static_cast<float>(round)).all().item<bool>());
    }
  }

  TEST_CASE(
      "offload_cuda: the same copies without the events read the data before it is there, so "
      "the test above fails without them" *
      doctest::skip(no_cuda || !kCanStall)) {
    const torch::Device gpu(torch::kCUDA, 0);
    const auto compute = sw::runtime::new_stream(gpu);
    const auto side = sw::runtime::new_stream(gpu);
    c10::StreamGuard on_compute(compute);
    const auto pinned = torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true);
    int stale_offloads = 0;
    int stale_reloads = 0;
    for (int round = 0; round < 4; ++round) {
      const float value = static_cast<float>(round + 1);
      // Offload without waiting for the compute stream: the copy reads x before its fill ran.
      stall(gpu);
      auto x = torch::full({1 << 24}, value, torch::TensorOptions().device(gpu));
      auto host = torch::empty({1 << 24}, pinned);
      {
        c10::StreamGuard guard(side);
        host.copy_(x, /*non_blocking=*/true);
      }
      side.synchronize();
      stale_offloads += !host.eq(value).all().item<bool>();
      torch::cuda::synchronize();
      // Reload without the compute stream waiting for it: the read runs before the copy lands.
      host.fill_(value);
      auto back = torch::zeros({1 << 24}, torch::TensorOptions().device(gpu));
      torch::cuda::synchronize();
      {
        c10::StreamGuard guard(side);
        stall(gpu);  // on the copy's stream
        back.copy_(host, /*non_blocking=*/true);
      }
      stale_reloads += !back.eq(value).all().item<bool>();  // on the compute stream, no wait
      torch::cuda::synchronize();
    }
    CHECK(stale_offloads == 4);
    CHECK(stale_reloads == 4);
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
