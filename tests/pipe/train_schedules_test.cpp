#include "stagewise/pipe.hpp"
#include "stagewise/schedule/chrome_trace.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/schedule_fixture.hpp"
#include "tests/support/wellformed.hpp"

#include <doctest/doctest.h>

#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::check_equal_to_reference;
using sw::testing::contains;
using sw::testing::count;
using sw::testing::error_of;
using sw::testing::grads_of;
using sw::testing::mlp;
using sw::testing::mse;
using sw::testing::reference_step;

namespace {

struct listed {
  std::vector<sched::Action> actions;
  sw::coro::generator<sched::Action> operator()(int, int) const {
    for (const auto& a : actions) co_yield a;
  }
};

sw::coro::generator<sched::Action> forwards_then_ascending(int stages, int micro_batches) {
  for (int s = 0; s < stages; ++s) {
    for (int i = 0; i < micro_batches; ++i)
      co_yield sched::Action{s, sched::ActionKind::forward, i};
    for (int i = 0; i < micro_batches; ++i)
      co_yield sched::Action{s, sched::ActionKind::backward, i};
  }
}

struct Boom : torch::autograd::Function<Boom> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("backward failed");
  }
};

}  // namespace

TEST_SUITE("train_step schedules") {
  TEST_CASE("GPipe's gradients equal unpipelined training in every checkpoint mode") {
    check_equal_to_reference(sched::gpipe{}, sw::balance{3, 2, 3}, false);
  }

  TEST_CASE("1F1B's gradients equal unpipelined training in every checkpoint mode") {
    check_equal_to_reference(sched::one_f_one_b{}, sw::balance{3, 2, 3}, true);
    check_equal_to_reference(sched::one_f_one_b{}, sw::balance{4, 4}, true);
  }

  TEST_CASE("interleaved 1F1B's gradients equal unpipelined training in every checkpoint mode") {
    check_equal_to_reference(sched::interleaved_one_f_one_b{2}, sw::balance{2, 2, 2, 2}, true);
    check_equal_to_reference(sched::interleaved_one_f_one_b{4}, sw::balance{1, 1, 1, 1, 1, 1, 1, 1},
                             true);
  }

  TEST_CASE(
      "zero-bubble's split I and W give gradients equal to unpipelined training in every mode") {
    check_equal_to_reference(sched::zero_bubble_h1{}, sw::balance{3, 2, 3}, true);
    check_equal_to_reference(sched::zero_bubble_h1{}, sw::balance{1, 1, 1, 1, 1, 1, 1, 1}, true);
  }

  TEST_CASE("a module applied twice in one stage trains under zero-bubble like one backward") {
    for (bool split : {false, true}) {
      CAPTURE(split);
      torch::manual_seed(7);
      torch::nn::Linear first(4, 4);
      torch::nn::Linear twice(4, 4);
      auto x = torch::randn({6, 4});
      auto t = torch::randn({6, 4});
      auto body = [&](const torch::Tensor& h) { return twice(torch::tanh(twice(h))); };
      // Reference: the same micro-batches, backward in order 0 .. M-1.
      for (int i = 0; i < 3; ++i) {
        (mse(body(first(x.chunk(3)[i])), t.chunk(3)[i]) * (1.0 / 3.0)).backward();
      }
      std::vector<torch::Tensor> expected{first->weight.grad().clone(),
                                          twice->weight.grad().clone(), twice->bias.grad().clone()};
      first->zero_grad();
      twice->zero_grad();
      auto pipe =
          sw::Pipe(sw::stages(first, body), sw::PipeOptions().chunks(3).checkpoint("never"));
      if (split) {
        pipe->train_step(x, t, mse, sched::zero_bubble_h1{});
      } else {
        pipe->train_step(x, t, mse, sched::one_f_one_b{});
      }
      CHECK(first->weight.grad().equal(expected[0]));
      CHECK(torch::allclose(twice->weight.grad(), expected[1], 1e-6, 1e-7));
      CHECK(torch::allclose(twice->bias.grad(), expected[2], 1e-6, 1e-7));
    }
  }

  TEST_CASE("dropout is replayed exactly under every schedule with checkpointing") {
    check_equal_to_reference(sched::one_f_one_b{}, sw::balance{3, 5}, true, 0.5);
    check_equal_to_reference(sched::zero_bubble_h1{}, sw::balance{3, 5}, true, 0.5);
    check_equal_to_reference(sched::interleaved_one_f_one_b{2}, sw::balance{2, 2, 2, 2}, true, 0.5);
  }

  TEST_CASE("a schedule written by the user as a coroutine trains") {
    check_equal_to_reference(forwards_then_ascending, sw::balance{3, 5}, true);
  }

  TEST_CASE("a broken schedule is rejected before anything runs") {
    auto seq = mlp();
    auto pipe = sw::Pipe(seq, sw::balance{3, 5}, sw::PipeOptions().chunks(2));
    using K = sched::ActionKind;
    listed broken{{{0, K::forward, 0},
                   {0, K::forward, 1},
                   {1, K::forward, 0},
                   {1, K::backward, 1},
                   {1, K::forward, 1},
                   {1, K::backward, 0},
                   {0, K::backward, 1},
                   {0, K::backward, 0}}};
    auto msg = error_of([&] {
      pipe->train_step(torch::randn({4, 6}), torch::randn({4, 3}), mse, broken);
    });
    CHECK(contains(msg,
                   "stagewise::schedule::verify: B1@1 (action #3) comes before F1@1 on stage 1"));
    for (auto& p : seq->parameters()) CHECK_FALSE(p.grad().defined());
    listed stuck{{{0, K::forward, 0},
                  {0, K::backward, 0},
                  {0, K::forward, 1},
                  {0, K::backward, 1},
                  {1, K::forward, 0},
                  {1, K::forward, 1},
                  {1, K::backward, 0},
                  {1, K::backward, 1}}};
    CHECK(contains(error_of([&] {
                     pipe->train_step(torch::randn({4, 6}), torch::randn({4, 3}), mse, stuck);
                   }),
                   "deadlock at B0@0 (action #1)"));
    CHECK(contains(error_of([&] {
                     pipe->train_step(torch::randn({4, 6}), torch::randn({4, 3}), mse,
                                      sched::interleaved_one_f_one_b{4});
                   }),
                   "2 stages do not split into 4 virtual stages per worker"));
  }

  TEST_CASE("an interleaved schedule runs v x K stages on K worker threads") {
    std::mutex mutex;
    std::map<int, std::set<std::thread::id>> threads;
    auto stage = [&](int k) {
      return [&, k](const torch::Tensor& x) {
        std::lock_guard<std::mutex> lock(mutex);
        threads[k].insert(std::this_thread::get_id());
        return x * 1.5;
      };
    };
    auto pipe = sw::Pipe(sw::stages(stage(0), stage(1), stage(2), stage(3), stage(4), stage(5)),
                         sw::PipeOptions().chunks(6).checkpoint("never"));
    auto x = torch::randn({6, 2}, torch::requires_grad());
    pipe->train_step(x, torch::randn({6, 2}), mse, sched::interleaved_one_f_one_b{3});
    REQUIRE(threads.size() == 6);
    for (int k = 0; k < 6; ++k) CHECK(threads[k].size() == 1);
    CHECK(threads[0] == threads[2]);
    CHECK(threads[0] == threads[4]);
    CHECK(threads[1] == threads[3]);
    CHECK(threads[1] == threads[5]);
    CHECK(threads[0] != threads[1]);
  }

  TEST_CASE("train_step records the real timeline as a Chrome trace with one event per action") {
    auto seq = mlp();
    auto pipe = sw::Pipe(seq, sw::balance{2, 2, 2, 2},
                         sw::PipeOptions().chunks(4).checkpoint("except_last"));
    sched::Timeline timeline;
    pipe->train_step(torch::randn({8, 6}), torch::randn({8, 3}), mse, sched::zero_bubble_h1{},
                     &timeline);
    const auto plan = sched::plan(sched::zero_bubble_h1{}, 4, 4, 3);
    CHECK(timeline.actions.size() == plan.size());
    CHECK(timeline.workers == 4);
    CHECK(timeline.unit == "us");
    CHECK(timeline.span() > 0.0);
    CHECK(timeline.bubble() >= 0.0);
    CHECK(timeline.bubble() < 1.0);
    // Each worker's actions follow its program, one after another.
    for (int w = 0; w < 4; ++w) {
      std::vector<sched::Action> ran;
      double last_end = 0.0;
      for (const auto& a : timeline.actions) {
        if (a.worker != w) continue;
        ran.push_back(a.action);
        CHECK(a.start >= last_end);
        CHECK(a.end >= a.start);
        last_end = a.end;
      }
      CHECK(ran == plan.programs[static_cast<std::size_t>(w)]);
    }
    const std::string path = sw::testing::temp_path("step.json");
    sched::write_chrome_trace(timeline, path);
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    CHECK(sw::testing::valid_json(text.str()));
    CHECK(count(text.str(), "\"ph\":\"X\"") == plan.size());
    CHECK(count(text.str(), "\"name\":\"R") == 4 * 3);
    CHECK(count(text.str(), "\"name\":\"W") == 4 * 4);
  }

  TEST_CASE("a failure in an input-gradient pass reaches the caller unchanged, and nothing hangs") {
    auto pipe =
        sw::Pipe(sw::stages(
                     torch::nn::Linear(2, 2), [](const torch::Tensor& x) { return Boom::apply(x); },
                     torch::nn::Linear(2, 2)),
                 sw::PipeOptions().chunks(3));
    CHECK_THROWS_WITH_AS(
        pipe->train_step(torch::rand({6, 2}), torch::rand({6, 2}), mse, sched::zero_bubble_h1{}),
        "backward failed", std::runtime_error);
    CHECK_THROWS_WITH_AS(
        pipe->train_step(torch::rand({6, 2}), torch::rand({6, 2}), mse, sched::one_f_one_b{}),
        "backward failed", std::runtime_error);
  }
}
