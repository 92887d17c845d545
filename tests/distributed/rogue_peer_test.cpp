#include "stagewise/distributed.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/keys.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"
#include "tests/support/wire_peer.hpp"

#include <doctest/doctest.h>

#include <sys/resource.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// Issue #37 from outside: a rank of the pipe that sends, under the pipe's own tags, bytes that
// are not what their headers announce. The honest ranks fail with a text naming it, the message
// and the byte counts or shapes, within the timeout, with no signal and nothing of a claimed
// 8 GiB allocated.

namespace sw = stagewise;
namespace rt = stagewise::runtime;
using rt::Message;
using rt::MessageKey;
using stagewise::schedule::TransferKind;
using stagewise::testing::contains;
using stagewise::testing::cut;
using stagewise::testing::error_of;
using stagewise::testing::first_transfer;
using stagewise::testing::honest;
using stagewise::testing::of;
using stagewise::testing::random_words;
using stagewise::testing::RankOutcome;
using stagewise::testing::report;
using stagewise::testing::run_ranks;
using stagewise::testing::Sends;
using namespace std::chrono_literals;

namespace {

// A three-stage pipe, one stage per rank: 16 rows in 4 micro-batches, activations [4, 8].
torch::nn::Sequential rogue_model() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

enum class Bad { short_inline, short_separate, longer, wrong_gradient, random, other_version };

// Rank 1 builds the pipe (so start-up passes) but runs no step: it sends, under the pipe's own
// tags, one bad message to rank 2 (an activation) or to rank 0 (a gradient, once rank 0 sent the
// activation it answers; 1F1B runs B0 first on every stage). Ranks 0 and 2 run the step and
// report its error, the time from the step's start to their pipe's end, and their peak memory.
std::vector<RankOutcome> rogue_job(Bad bad) {
  return run_ranks(
      3,
      [bad](int rank) {
        auto c = rt::connect(rt::rendezvous_env(), rt::ConnectOptions{10s});
        const auto seq = rogue_model();
        const auto dist = sw::distributed::Options().timeout(10s);
        const auto options = sw::PipeOptions().chunks(4);
        if (rank == 1) {
          sw::distributed::Pipe pipe(c, seq, sw::balance{2, 2, 1}, options, dist);
          Sends send{c, {}};
          const MessageKey activation{TransferKind::activation, 2, 0};
          const auto right = Message{{torch::ones({4, 8})}, true};
          switch (bad) {
            case Bad::short_inline:  // 1024 bytes: 63 words, 128 of tensor, zeros, end mark
              send(cut(honest(right)[0], 71), 2, activation);
              break;
            case Bad::short_separate: {
              const auto t = honest(right, 0);
              send(t[0], 2, activation);
              send(t[1].reshape({-1}).narrow(0, 0, 16), 2, activation);
              break;
            }
            case Bad::longer: {
              auto t = honest(right, 0);
              t[0][10] = 256;  // [mark, words, 1, flags, 512, 1, dtype, 2, 4, 8, bytes, tail]
              send(t[0], 2, activation);
              send(torch::ones({8, 8}), 2, activation);
              break;
            }
            case Bad::wrong_gradient: {
              // After rank 0's activation of micro-batch 0 left (read here as it arrives).
              auto first = torch::empty({rt::detail::first_bytes(rt::detail::kInlineBytes) / 8},
                                        torch::kInt64);
              std::vector<at::Tensor> in{first};
              c.group.recv(in, 0, rt::detail::message_tag({TransferKind::activation, 1, 0}, 0))
                  ->wait();
              const std::int64_t f32 = static_cast<std::int64_t>(c10::ScalarType::Float);
              send(first_transfer({rt::detail::header_mark(), 12, 1, 1, 512, 1, f32, 2, 65536,
                                   32768, std::int64_t{8} << 30, 0}),
                   0, {TransferKind::gradient, 0, 0});
              break;
            }
            case Bad::random:
              send(random_words(), 2, activation);
              break;
            case Bad::other_version: {
              auto t = honest(right);
              t[0][0] = rt::detail::header_mark(1);
              send(t[0], 2, activation);
              break;
            }
          }
          // Connected until the others are through: a closed connection would be their error.
          const auto until = std::chrono::steady_clock::now() + 30s;
          while (c.store->add("honest done", 0) < 2 && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(5ms);
          }
          c.store->set("rogue done", std::vector<std::uint8_t>{1});
          return;
        }
        torch::manual_seed(11);
        const auto x = torch::randn({16, 6});
        const auto y = torch::randn({16, 3});
        const auto start = std::chrono::steady_clock::now();
        {
          sw::distributed::Pipe pipe(c, seq, sw::balance{2, 2, 1}, options, dist);
          report(error_of([&] {
            pipe->train_step(
                x, y,
                [](const torch::Tensor& out, const torch::Tensor& t) {
                  return torch::nn::functional::mse_loss(out, t);
                },
                sw::schedule::one_f_one_b{});
          }));
        }
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - start)
                            .count();
        rusage usage{};
        ::getrusage(RUSAGE_SELF, &usage);
        report("\nms " + std::to_string(ms) + "\nrss_mib " +
               std::to_string(usage.ru_maxrss / 1024));
        c.store->add("honest done", 1);
        if (rank == 0) c.store->wait({"rogue done"});  // it serves the store
      },
      60s);
}

// What a rank reported: its error (the first line), and a number it reported as "<name> <n>".
std::string error_line(const RankOutcome& o) {
  return o.text.substr(0, o.text.find('\n'));
}
long number(const RankOutcome& o, const std::string& name) {
  const auto at = o.text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stol(o.text.substr(at + name.size() + 2));
}

}  // namespace

TEST_SUITE("a rogue rank") {
  TEST_CASE("bad bytes under the pipe's tags fail the honest ranks clearly, in time, no signal") {
    const std::string activation = "rank 1 (for the activation of micro-batch 0 for stage 2)";
    const std::vector<std::pair<Bad, std::string>> cases{
        {Bad::short_inline, "stagewise: a message from " + activation +
                                " is cut short: its header announces a first transfer of 1024 "
                                "bytes, but fewer arrived (its end mark is missing)"},
        {Bad::short_separate, "stagewise: a message from " + activation +
                                  " is cut short: tensor 0 (Float [4, 8]) should arrive as a "
                                  "transfer of 128 bytes, but it ended early"},
        {Bad::longer, "stagewise: a message header from " + activation +
                          " is corrupt: tensor 0 is announced as a transfer of 256 bytes, but "
                          "Float [4, 8] holds 128 (refused before receiving it)"},
        {Bad::wrong_gradient,
         "stagewise: rank 1 sent the gradient of micro-batch 0 for stage 0 with tensor 0 Float "
         "[65536, 32768], but this rank sent it the activation of micro-batch 0 for stage 1 with "
         "tensor 0 Float [4, 8]: a gradient has a tensor per tensor sent, of its dtype and shape "
         "(or none)."},
        {Bad::random, "stagewise: a message header from " + activation +
                          " is garbled (no stagewise header mark)"},
        {Bad::other_version, "stagewise: a message header from " + activation +
                                 " is in wire format version 1, but this rank reads version 2"},
    };
    for (const auto& [bad, text] : cases) {
      CAPTURE(text);
      const auto r = rogue_job(bad);
      const int victim = bad == Bad::wrong_gradient ? 0 : 2;
      const int other = 2 - victim;
      for (int k : {0, 2}) {
        CAPTURE(k);
        INFO(of(r, k).text);
        CHECK(of(r, k).status == 0);  // ended normally: no signal, no timeout
        CHECK_FALSE(of(r, k).timed_out);
        CHECK(contains(error_line(of(r, k)), text));
        CHECK(number(of(r, k), "ms") >= 0);
        CHECK(number(of(r, k), "ms") < 10000);  // within the timeout
        CHECK(number(of(r, k), "rss_mib") >= 0);
        CHECK(number(of(r, k), "rss_mib") < 1024);  // nothing of the 8 GiB allocated
      }
      // The rank that got the message fails with its own error; the other learns it from it.
      CHECK(error_line(of(r, victim)).starts_with(text));
      CHECK(contains(error_line(of(r, other)),
                     "stagewise: rank " + std::to_string(victim) + " failed: " + text));
      CHECK(contains(error_line(of(r, other)), "Rank " + std::to_string(other) + " stops too."));
    }
  }
}
