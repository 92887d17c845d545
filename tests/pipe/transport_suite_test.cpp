// The shared transport tests (tests/support/transport_suite.hpp) over the in-process transport
// (stagewise::Pipe, one process) and over the tests' own wire (tests/support/wire_transport.hpp:
// two ranks in one process, each a PipeOver<WireEnd>). The distributed folder runs them over
// C10dTransport in two processes.

#include "stagewise/pipe.hpp"
#include "stagewise/pipe/pipe_over.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"

#include "tests/support/transport_suite.hpp"
#include "tests/support/wire_transport.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <array>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;
namespace suite = sw::testing::transport_suite;

static_assert(sw::runtime::pipe_transport<sw::runtime::MailboxTransport>);
static_assert(sw::runtime::value_gathering_transport<sw::runtime::MailboxTransport>);
// The wire has no gather_values: a clipped step's norms cross through its text gather.
static_assert(!sw::runtime::value_gathering_transport<sw::testing::WireEnd>);

namespace {

std::string fresh_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("stagewise_suite_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

// The k-th pipe either rank makes shares the k-th wire.
struct Wires {
  std::mutex mutex;
  std::vector<std::shared_ptr<sw::testing::Wire>> made;
  std::shared_ptr<sw::testing::Wire> at(std::size_t k) {
    std::lock_guard<std::mutex> lock(mutex);
    while (made.size() <= k) made.push_back(std::make_shared<sw::testing::Wire>());
    return made[k];
  }
};

}  // namespace

TEST_SUITE("shared transport tests") {
  TEST_CASE("the in-process transport (stagewise::Pipe) passes them") {
    const auto dir = fresh_dir("mailbox");
    suite::run_all([](const torch::nn::Sequential& seq, const sw::balance& b,
                      const sw::PipeOptions& o) { return sw::Pipe(seq, b, o); },
                   dir);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("a transport of the test's own, from one header, passes them on two ranks") {
    const auto dir = fresh_dir("wire");
    Wires wires;
    std::array<std::string, 2> errors;
    auto rank_main = [&](int rank) {
      std::size_t made = 0;
      auto make = [&](const torch::nn::Sequential& seq, const sw::balance& b,
                      const sw::PipeOptions& o) {
        return sw::testing::WirePipe(
            seq, b, o, std::make_unique<sw::testing::WireEnd>(wires.at(made++), rank));
      };
      errors[static_cast<std::size_t>(rank)] =
          sw::testing::error_of([&] { suite::run_all(make, dir); });
    };
    std::thread r0(rank_main, 0), r1(rank_main, 1);
    r0.join();
    r1.join();
    CHECK(errors[0] == "(no error)");
    CHECK(errors[1] == "(no error)");
    std::filesystem::remove_all(dir);
  }
}
