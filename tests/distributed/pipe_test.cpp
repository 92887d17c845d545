#include "stagewise/pipe.hpp"
#include "stagewise/distributed.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"
#include "tests/support/pipe_layers.hpp"

#include <doctest/doctest.h>

#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace dp {

using sw::testing::Pop;
using sw::testing::Stash;
using sw::testing::Trap;

// Four stages' worth of layers (balance {2, 2, 2, 2} or {4, 4}); with `skip`, layer 1 stashes and
// layer 6 pops, so the skip crosses from the first rank to the last.
torch::nn::Sequential model(bool skip, int out = 3) {
  torch::manual_seed(7);
  torch::nn::Sequential s;
  s->push_back(torch::nn::Linear(6, 8));
  if (skip) {
    s->push_back(Stash());
  } else {
    s->push_back(torch::nn::Tanh());
  }
  s->push_back(torch::nn::Linear(8, 8));
  s->push_back(torch::nn::Tanh());
  s->push_back(torch::nn::Linear(8, 8));
  s->push_back(torch::nn::Tanh());
  if (skip) {
    s->push_back(Pop());
  } else {
    s->push_back(torch::nn::Identity());
  }
  s->push_back(torch::nn::Linear(8, out));
  return s;
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

// 10 rows in 4 chunks: micro-batches of 3, 3, 3 and 1 rows.
std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  auto x = torch::randn({10, 6});
  auto y = torch::randn({10, 3});
  return {x, y};
}

void expect(bool ok, const std::string& what) {
  TORCH_CHECK(ok, what);
}

// Trains the distributed pipe and the one-process pipe side by side for three steps (SGD) and
// checks, on this rank, the loss of every step and the parameters of this rank's layers, bit for
// bit. `fused` uses FusedStep on the distributed side.
template <class Schedule>
void compare(const sw::runtime::Connection& c, const std::string& name, const Schedule& s,
             int virtual_stages, sw::Checkpoint mode, bool skip, bool fused) {
  auto seq = model(skip);
  auto ref_seq = model(skip);
  const auto b = virtual_stages == 2 ? sw::balance{2, 2, 2, 2} : sw::balance{4, 4};
  auto options = sw::PipeOptions().chunks(4).checkpoint(mode);
  auto dist = sw::distributed::Options()
                  .virtual_stages(virtual_stages)
                  .transport(sw::runtime::C10dOptions().prefix(name).timeout(20s));
  if constexpr (sched::placed_schedule<Schedule>) dist.placed_like(s);
  sw::distributed::Pipe pipe(c, seq, b, options, dist);
  auto ref = sw::Pipe(ref_seq, b, options);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.1));
  std::optional<sw::optim::FusedStep> fused_step;
  if (fused) fused_step.emplace(pipe->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    const bool first = pipe->has_stage(0), last = pipe->has_stage(pipe->num_stages() - 1);
    const auto in = first ? x : torch::Tensor();
    const auto target = last ? y : torch::Tensor();
    torch::Tensor loss;
    if (fused) {
      loss = pipe->train_step(in, target, mse, *fused_step, s);
    } else {
      loss = pipe->train_step(in, target, mse, s);
      opt.step();
      opt.zero_grad();
    }
    auto ref_loss = ref->train_step(x, y, mse, s);
    ref_opt.step();
    ref_opt.zero_grad();
    expect(torch::equal(loss, ref_loss), name + ": the loss of step " + std::to_string(step) +
                                             " differs from the one-process pipe's");
  }
  int layer = 0;
  for (std::size_t j = 0; j < b.size(); ++j) {
    for (int k = 0; k < b[j]; ++k, ++layer) {
      if (!pipe->has_stage(static_cast<int>(j))) continue;
      auto mine = seq[static_cast<std::size_t>(layer)]->parameters();
      auto theirs = ref_seq[static_cast<std::size_t>(layer)]->parameters();
      for (std::size_t p = 0; p < mine.size(); ++p) {
        expect(torch::equal(mine[p], theirs[p]),
               name + ": layer " + std::to_string(layer) + " differs after three steps");
      }
    }
  }
}

const char* mode_name(sw::Checkpoint m) {
  return m == sw::Checkpoint::always ? "always" : m == sw::Checkpoint::never ? "never" : "except";
}

}  // namespace dp

TEST_SUITE("distributed pipe") {
  TEST_CASE("parameters after three steps equal the one-process pipe's, every schedule and mode") {
    auto r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          for (auto mode :
               {sw::Checkpoint::always, sw::Checkpoint::except_last, sw::Checkpoint::never}) {
            const std::string m = dp::mode_name(mode);
            dp::compare(c, "gpipe-" + m, sched::gpipe{}, 1, mode, false, false);
            dp::compare(c, "1f1b-" + m, sched::one_f_one_b{}, 1, mode, false, false);
            dp::compare(c, "zb-" + m, sched::zero_bubble_h1{}, 1, mode, false, false);
            dp::compare(c, "il-" + m, sched::interleaved_one_f_one_b{2}, 2, mode, false, false);
            dp::compare(c, "bfs-" + m, sched::looped_bfs{2}, 2, mode, false, false);
            dp::compare(c, "zbv-" + m, sched::zero_bubble_v{}, 2, mode, false, false);
            dp::compare(c, "dpv-" + m, sched::dualpipe_v{}, 2, mode, false, false);
            dp::compare(c, "vh-" + m, sched::v_half{}, 2, mode, false, false);
            dp::compare(c, "vm-" + m, sched::v_min{}, 2, mode, false, false);
          }
        },
        240s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }

  TEST_CASE("skips across ranks and the fused step match the one-process pipe") {
    auto r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          for (auto mode :
               {sw::Checkpoint::always, sw::Checkpoint::except_last, sw::Checkpoint::never}) {
            const std::string m = dp::mode_name(mode);
            dp::compare(c, "skip-gpipe-" + m, sched::gpipe{}, 1, mode, true, false);
            dp::compare(c, "skip-1f1b-" + m, sched::one_f_one_b{}, 1, mode, true, false);
            dp::compare(c, "skip-zb-" + m, sched::zero_bubble_h1{}, 1, mode, true, false);
            dp::compare(c, "skip-il-" + m, sched::interleaved_one_f_one_b{2}, 2, mode, true, false);
            dp::compare(c, "skip-zbv-" + m, sched::zero_bubble_v{}, 2, mode, true, false);
            dp::compare(c, "skip-vh-" + m, sched::v_half{}, 2, mode, true, false);
            dp::compare(c, "fused-vm-" + m, sched::v_min{}, 2, mode, false, true);
            dp::compare(c, "fused-gpipe-" + m, sched::gpipe{}, 1, mode, false, true);
            dp::compare(c, "fused-1f1b-" + m, sched::one_f_one_b{}, 1, mode, false, true);
            dp::compare(c, "fused-zb-" + m, sched::zero_bubble_h1{}, 1, mode, false, true);
            dp::compare(c, "fused-il-" + m, sched::interleaved_one_f_one_b{2}, 2, mode, false,
                        true);
          }
          dp::compare(c, "fused-skip-1f1b", sched::one_f_one_b{}, 1, sw::Checkpoint::except_last,
                      true, true);
        },
        240s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }

  TEST_CASE("traffic counts the messages and tensor bytes that cross ranks, skips included") {
    auto r = run_ranks(
        2,
        [](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          // [Linear(6,8), Stash, Linear, Tanh] on rank 0, [Linear, Tanh, Pop, Linear(8,3)] on
          // rank 1; 10 rows in 4 micro-batches. Each direction carries 10 rows of 8 floats as
          // activations (gradients) and 10 more as the skip (its gradient): 8 messages, 640 bytes.
          sw::distributed::Pipe pipe(
              c, dp::model(true), sw::balance{4, 4}, sw::PipeOptions().chunks(4),
              sw::distributed::Options().transport(sw::runtime::C10dOptions().prefix("traffic")));
          const auto none = pipe->traffic();
          dp::expect(none.messages_sent == 0 && none.bytes_sent == 0 &&
                         none.messages_received == 0 && none.bytes_received == 0,
                     "traffic before any step is not zero");
          auto [x, y] = dp::batch(0);
          for (int step = 1; step <= 2; ++step) {
            pipe->train_step(rank == 0 ? x : torch::Tensor(), rank == 1 ? y : torch::Tensor(),
                             dp::mse, sched::one_f_one_b{});
            const auto t = pipe->traffic();
            for (auto [what, got, want] :
                 {std::tuple{"messages sent", t.messages_sent, 8 * step},
                  std::tuple{"bytes sent", t.bytes_sent, 640 * step},
                  std::tuple{"messages received", t.messages_received, 8 * step},
                  std::tuple{"bytes received", t.bytes_received, 640 * step}}) {
              dp::expect(got == want, std::string(what) + " after step " + std::to_string(step) +
                                          ": " + std::to_string(got) + ", want " +
                                          std::to_string(want));
            }
          }
        },
        60s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }

  TEST_CASE("a stage that throws on one rank fails every rank with its message, no hang") {
    auto r = run_ranks(
        2,
        [](int) {
          auto seq = dp::model(false);
          dp::Trap trap;  // on rank 1, the last stage
          trap->at = 2;
          seq->push_back(trap);
          sw::distributed::Pipe pipe(seq, sw::balance{4, 5}, sw::PipeOptions().chunks(4),
                                     sw::distributed::Options().timeout(20s));
          auto [x, y] = dp::batch(0);
          report(error_of([&] { pipe->train_step(x, y, dp::mse, sched::one_f_one_b{}); }));
        },
        60s);
    // The error names the cell that raised it, on its own rank and on the others.
    CHECK(r[1].text == "trap sprung in forward (stagewise: stage 1, micro-batch 1, forward)");
    // Rank 0 learns it while waiting for a message, or in a send from a cell of its own, which
    // the text then names after this.
    INFO(r[0].text);
    CHECK(r[0].text.starts_with(
        "stagewise: rank 1 failed: trap sprung in forward (stagewise: stage 1, micro-batch 1, "
        "forward). Rank 0 stops too."));
  }

  TEST_CASE("the pipe is a module holder: this rank's stages are its children, moves refused") {
    auto r = run_ranks(
        2,
        [](int) {
          auto seq = dp::model(false);
          sw::distributed::Pipe pipe(seq, sw::balance{2, 2, 2, 2}, sw::PipeOptions().chunks(2),
                                     sw::distributed::Options().virtual_stages(2).timeout(20s));
          // Stages 0 and 2 on rank 0, 1 and 3 on rank 1; only this rank's are registered.
          std::string out;
          for (const auto& item : pipe->named_children()) out += item.key() + " ";
          std::size_t expected = 0;
          for (int j = 0; j < pipe->num_stages(); ++j) {
            if (!pipe->has_stage(j)) continue;
            for (std::size_t k = 2 * static_cast<std::size_t>(j); k < 2 * j + 2u; ++k) {
              expected += seq[k]->parameters().size();
            }
          }
          out += "| " + std::to_string(pipe->parameters().size() == expected) + " ";
          pipe->eval();
          bool all_eval = !pipe->is_training();
          for (const auto& child : pipe->children()) all_eval = all_eval && !child->is_training();
          out += std::to_string(all_eval) + " | ";
          out += error_of([&] { pipe->to(torch::Device(torch::kCPU)); });
          report(out);
        },
        60s);
    const std::string refused =
        "stagewise::distributed::Pipe: cannot move the pipe to cpu: each stage lives on the "
        "device it was given. Build the pipe with PipeOptions().devices(...) to place stages "
        "elsewhere (changing the dtype is allowed).";
    CHECK(r[0].text == "stage0 stage2 | 1 1 | " + refused);
    CHECK(r[1].text == "stage1 stage3 | 1 1 | " + refused);
  }

  TEST_CASE("a rank killed in the middle of a step fails the others, naming it, no hang") {
    auto r = run_ranks(
        2,
        [](int) {
          auto seq = dp::model(false);
          dp::Trap trap;
          trap->at = 1;
          trap->kill = true;
          seq->push_back(trap);
          sw::distributed::Pipe pipe(seq, sw::balance{4, 5}, sw::PipeOptions().chunks(4),
                                     sw::distributed::Options().timeout(20s));
          auto [x, y] = dp::batch(0);
          report(error_of([&] { pipe->train_step(x, y, dp::mse, sched::gpipe{}); }));
        },
        60s);
    CHECK(r[1].status == -SIGKILL);
    CHECK(contains(r[0].text, "stagewise: rank 1 is gone: its connection closed while rank 0"));
  }

  TEST_CASE("a pipe started without the torchrun variables names the missing one and the fix") {
    auto r = run_ranks(
        1,
        [](int) {
          ::unsetenv("WORLD_SIZE");
          report(error_of([] { sw::distributed::Pipe(dp::model(false), sw::balance{4, 4}); }));
        },
        30s);
    CHECK(r[0].status == 0);
    CHECK(r[0].text ==
          "stagewise: the environment variable WORLD_SIZE is not set. Start every rank with "
          "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set, as torchrun does, e.g. "
          "tools/launch -n 2 -- ./train");
  }

  TEST_CASE("bad configurations are named on every rank before any step") {
    auto r = run_ranks(
        2,
        [](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          std::string out;
          out += error_of([&] {
                   sw::distributed::Pipe(c, dp::model(false), sw::balance{3, 3, 2});
                 }) +
                 "\n";
          auto odd = dp::model(false, rank == 1 ? 4 : 3);
          out +=
              error_of([&] {
                sw::distributed::Pipe(
                    c, odd, sw::balance{4, 4}, {},
                    sw::distributed::Options().transport(sw::runtime::C10dOptions().prefix("odd")));
              }) +
              "\n";
          sw::distributed::Pipe pipe(
              c, dp::model(false), sw::balance{4, 4}, {},
              sw::distributed::Options().transport(sw::runtime::C10dOptions().prefix("il")));
          auto [x, y] = dp::batch(0);
          out += error_of(
                     [&] { pipe->train_step(x, y, dp::mse, sched::interleaved_one_f_one_b{2}); }) +
                 "\n";
          sw::distributed::Pipe round_robin(c, dp::model(false), sw::balance{2, 2, 2, 2}, {},
                                            sw::distributed::Options().virtual_stages(2).transport(
                                                sw::runtime::C10dOptions().prefix("v")));
          out += error_of([&] { round_robin->train_step(x, y, dp::mse, sched::zero_bubble_v{}); });
          report(out);
        },
        60s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text ==
            "stagewise::distributed: the pipe has 3 stages on 3 workers, one per rank, but "
            "WORLD_SIZE is 2; start 3 ranks (tools/launch -n 3), or change the balance or the "
            "schedule's virtual stages to fit 2 ranks\n"
            "stagewise::distributed: ranks 0 and 1 built different stage 1: rank 0 has {4.weight "
            "Float [8, 8]; 4.bias Float [8]; 7.weight Float [3, 8]; 7.bias Float [3]}, rank 1 has "
            "{4.weight Float [8, 8]; 4.bias Float [8]; 7.weight Float [4, 8]; 7.bias Float [4]}; "
            "every rank must build the same model and balance\n"
            "stagewise::distributed::Pipe::train_step: the schedule runs the 2 stages on 1 "
            "workers but the pipe runs them on 2 ranks; build the pipe with "
            "Options().placed_like(schedule) for a V-shaped schedule or "
            "Options().virtual_stages(v) for v stages per rank (now 1), or pass a schedule that "
            "places stage j on rank j % 2\n"
            "stagewise::distributed::Pipe::train_step: the schedule runs stage 2 on worker 1 but "
            "the pipe keeps it on rank 0; build the pipe with Options().placed_like(schedule) for "
            "a V-shaped schedule or Options().virtual_stages(v) for v stages per rank (now 2), or "
            "pass a schedule that places stage j on rank j % 2");
    }
  }
}
