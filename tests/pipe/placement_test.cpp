#include "stagewise/pipe/placement.hpp"

#include <torch/cuda.h>
#include <torch/types.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

const std::size_t gpus = torch::cuda::device_count();
const bool has_gpu = gpus > 0;
const torch::Device cpu(torch::kCPU);

std::vector<torch::Device> all(std::size_t n, torch::Device d) {
  return std::vector<torch::Device>(n, d);
}

}  // namespace

TEST_SUITE("place_stages") {
  TEST_CASE("auto puts every stage on the CPU when there is no GPU" * doctest::skip(has_gpu)) {
    CHECK(sw::place_stages(3) == all(3, cpu));
    CHECK(sw::place_stages(1, "auto") == all(1, cpu));
  }

  TEST_CASE("cpu puts every stage on the CPU, GPUs or not") {
    CHECK(sw::place_stages(4, "cpu") == all(4, cpu));
  }

  TEST_CASE("a comma list gives exactly those devices, one per stage") {
    CHECK(sw::place_stages(3, "cpu,cpu,cpu") == all(3, cpu));
  }

  TEST_CASE("no stages give no devices") {
    CHECK(sw::place_stages(0).empty());
    CHECK(sw::place_stages(0, "cpu").empty());
  }

  TEST_CASE("an unknown form is refused with the accepted forms") {
    for (const std::string spec : {"gpu", "CPU", "cuda:", "cuda:x", "cuda:1234", "", "mps"}) {
      CAPTURE(spec);
      const auto e = error_of([&] { sw::place_stages(2, spec); });
      CHECK(contains(e, "stagewise::place_stages: unknown device \"" + spec + "\"; use \"auto\""));
      CHECK(contains(e, "\"cpu\", \"cuda\""));
      CHECK(contains(e, "\"cuda:N\""));
      CHECK(contains(e, "separated by commas (\"cpu,cuda:0\")"));
    }
  }

  TEST_CASE("a bad entry of a comma list is named with the list") {
    CHECK(contains(error_of([] { sw::place_stages(2, "cpu,gpu"); }),
                   "unknown device \"gpu\" in \"cpu,gpu\"; use \"auto\""));
    CHECK(
        contains(error_of([] { sw::place_stages(2, "cpu,"); }), "unknown device \"\" in \"cpu,\""));
    CHECK(contains(error_of([] { sw::place_stages(2, "cpu,cuda"); }),
                   "unknown device \"cuda\" in \"cpu,cuda\""));
  }

  TEST_CASE("a comma list of the wrong length is refused, naming both numbers") {
    const auto e = error_of([] { sw::place_stages(3, "cpu,cpu"); });
    CHECK(contains(e,
                   "stagewise::place_stages: \"cpu,cpu\" names 2 devices for 3 stages; give "
                   "exactly one device per stage, or one device (\"cpu\", \"cuda:0\") for all"));
    CHECK(
        contains(error_of([] { sw::place_stages(1, "cpu,cpu"); }), "names 2 devices for 1 stage;"));
  }

  TEST_CASE("a GPU that is not there is refused, naming how many there are") {
    const std::string missing = "cuda:" + std::to_string(gpus);
    const auto e = error_of([&] { sw::place_stages(2, missing); });
    CHECK(contains(e, "stagewise::place_stages: \"" + missing +
                          "\" asks for a GPU that is not there: this machine has " +
                          std::to_string(gpus) + " CUDA GPU"));
    CHECK(contains(error_of([&] { sw::place_stages(2, "cpu," + missing); }),
                   "\"" + missing + "\" in \"cpu," + missing + "\" asks for a GPU"));
  }

  TEST_CASE("without a GPU, cuda:N says to use the CPU or auto" * doctest::skip(has_gpu)) {
    CHECK(contains(error_of([] { sw::place_stages(2, "cuda:0"); }),
                   "this machine has 0 CUDA GPUs; use \"cpu\", or \"auto\" to take a GPU only "
                   "when there is one"));
  }

  TEST_CASE("cuda without a GPU is refused, naming auto and cpu" * doctest::skip(has_gpu)) {
    CHECK(contains(
        error_of([] { sw::place_stages(2, "cuda"); }),
        "stagewise::place_stages: \"cuda\" asks for a GPU, but this machine has no CUDA GPU "
        "(torch::cuda::device_count() is 0); use \"auto\" to fall back to the CPU, or "
        "\"cpu\""));
  }

  TEST_CASE(
      "placement_cuda: auto puts one stage per GPU, or all on cuda:0 when stages outnumber GPUs" *
      doctest::skip(!torch::cuda::is_available())) {
    std::vector<torch::Device> each;
    for (std::size_t k = 0; k < gpus; ++k) {
      each.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(k));
    }
    CHECK(sw::place_stages(gpus) == each);
    CHECK(sw::place_stages(gpus, "cuda") == each);
    CHECK(sw::place_stages(1) == all(1, torch::Device(torch::kCUDA, 0)));
    CHECK(sw::place_stages(gpus + 1) == all(gpus + 1, torch::Device(torch::kCUDA, 0)));
  }

  TEST_CASE("placement_cuda: cuda:N and a mixed list place exactly there" *
            doctest::skip(!torch::cuda::is_available())) {
    const torch::Device last(torch::kCUDA, static_cast<c10::DeviceIndex>(gpus - 1));
    CHECK(sw::place_stages(3, "cuda:" + std::to_string(gpus - 1)) == all(3, last));
    CHECK(sw::place_stages(2, "cpu,cuda:0") ==
          std::vector<torch::Device>{cpu, torch::Device(torch::kCUDA, 0)});
  }

  TEST_CASE("placement_cuda: a GPU beyond the last is refused, listing those there are" *
            doctest::skip(gpus < 2)) {
    CHECK(contains(error_of([] { sw::place_stages(2, "cuda:" + std::to_string(gpus)); }),
                   " CUDA GPUs (cuda:0 .. cuda:" + std::to_string(gpus - 1) +
                       "); use one of those, or \"auto\""));
  }
}
