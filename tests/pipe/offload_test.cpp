// Activation offload in train_step: a pipe with offload (file store, host store) trains exactly as
// the same pipe without it, over every schedule, checkpoint mode, skips, dropout and the fused
// step; a store that fails fails the step, names itself and the fix, and loses nothing.
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/pipe.hpp"
#include "stagewise/runtime/file_store.hpp"
#include "stagewise/runtime/host_store.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/v_min.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include <torch/torch.h>

#include "tests/support/autocast.hpp"
#include "tests/support/errors.hpp"
#include "tests/support/pipe_layers.hpp"

#include <doctest/doctest.h>

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

// Eight layers with a skip from layer 1 to layer 5 (across stages) and dropout.
torch::nn::Sequential model() {
  return torch::nn::Sequential(torch::nn::Linear(6, 16), sw::testing::Stash(), torch::nn::Tanh(),
                               torch::nn::Dropout(0.2), torch::nn::Linear(16, 16),
                               sw::testing::Pop(), torch::nn::Tanh(), torch::nn::Linear(16, 3));
}

// A fresh directory for a file store.
std::string temp_dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(base ? base : "/tmp") + "/stagewise_offload_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

struct Trained {
  std::vector<torch::Tensor> parameters;
  std::vector<float> losses;
  int offloads = 0;  // O actions run in the last step
};

// Three steps of `s` on a fresh model over `b`, with `store` (or none), with SGD or the fused
// Adam step; the data and dropout draw from one seed, so two runs see the same numbers.
Trained train(std::optional<sw::runtime::AnyStore> store, const sched::any_schedule& s,
              const sw::balance& b, sw::Checkpoint mode, bool fused, bool autocast = false) {
  torch::manual_seed(5);
  auto m = model();
  auto options = sw::PipeOptions().chunks(8).checkpoint(mode);  // DualPipeV needs 2 x workers
  // Free copies: every checkpointed cell past stage 0 is offloaded.
  if (store) options.offload(*store, {.costs = {.offload = 0.0}});
  auto pipe = sw::Pipe(m, b, options);
  torch::optim::SGD sgd(pipe->parameters(), torch::optim::SGDOptions(0.1));
  std::optional<sw::optim::FusedStep> adam;
  if (fused) adam.emplace(pipe->parameters(), torch::optim::AdamOptions(0.01));
  Trained out;
  torch::manual_seed(9);
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({15, 6});  // 8 micro-batches, the last smaller
    const auto t = torch::randn({15, 3});
    sched::Timeline timeline;
    std::optional<sw::testing::CpuAutocastRegion> region;
    if (autocast) region.emplace();  // bf16 on the CPU, captured by the workers
    if (fused) {
      out.losses.push_back(pipe->train_step(x, t, mse, *adam, s, &timeline).item<float>());
    } else {
      sgd.zero_grad();
      out.losses.push_back(pipe->train_step(x, t, mse, s, &timeline).item<float>());
      sgd.step();
    }
    out.offloads = 0;
    for (const auto& a : timeline.actions)
      out.offloads += a.action.kind == sched::ActionKind::offload;
  }
  for (const auto& p : m->parameters()) out.parameters.push_back(p.detach().clone());
  return out;
}

void check_same(const Trained& a, const Trained& b) {
  CHECK(a.losses == b.losses);
  REQUIRE(a.parameters.size() == b.parameters.size());
  for (std::size_t k = 0; k < a.parameters.size(); ++k)
    CHECK(a.parameters[k].equal(b.parameters[k]));
}

}  // namespace

TEST_SUITE("offload") {
  TEST_CASE("a pipe with offload equals the pipe without it, bit for bit, on every schedule") {
    const std::vector<std::pair<sched::any_schedule, sw::balance>> cases{
        {sched::any_schedule("gpipe", sched::gpipe{}), sw::balance{2, 2, 2, 2}},
        {sched::any_schedule("one_f_one_b", sched::one_f_one_b{}), sw::balance{2, 2, 2, 2}},
        {sched::any_schedule("zero_bubble_h1", sched::zero_bubble_h1{}), sw::balance{2, 2, 2, 2}},
        {sched::any_schedule("interleaved{2}", sched::interleaved_one_f_one_b{2}),
         sw::balance{1, 1, 1, 1, 1, 1, 1, 1}},
        {sched::any_schedule("zero_bubble_v", sched::zero_bubble_v{}),
         sw::balance{1, 1, 1, 1, 1, 1, 1, 1}},
        {sched::any_schedule("v_half", sched::v_half{}), sw::balance{1, 1, 1, 1, 1, 1, 1, 1}},
        {sched::any_schedule("v_min", sched::v_min{}), sw::balance{1, 1, 1, 1, 1, 1, 1, 1}},
        {sched::any_schedule("dualpipe_v", sched::dualpipe_v{}),
         sw::balance{1, 1, 1, 1, 1, 1, 1, 1}},
    };
    const std::string dir = temp_dir("schedules");
    for (const auto& [s, b] : cases) {
      for (auto mode : {sw::Checkpoint::always, sw::Checkpoint::except_last}) {
        CAPTURE(s.name());
        CAPTURE(sw::to_string(mode));
        const auto plain = train(std::nullopt, s, b, mode, false);
        const auto file = train(sw::runtime::FileStore(dir), s, b, mode, false);
        const auto host = train(sw::runtime::HostStore(), s, b, mode, false);
        CHECK(file.offloads > 0);
        CHECK(host.offloads == file.offloads);
        check_same(plain, file);
        check_same(plain, host);
      }
    }
  }

  TEST_CASE("offload with the optimizer fused into backward equals the fused step without it") {
    const std::string dir = temp_dir("fused");
    for (const auto& s : {sched::any_schedule("one_f_one_b", sched::one_f_one_b{}),
                          sched::any_schedule("zero_bubble_h1", sched::zero_bubble_h1{})}) {
      CAPTURE(s.name());
      const auto plain =
          train(std::nullopt, s, sw::balance{2, 2, 2, 2}, sw::Checkpoint::always, true);
      const auto file = train(sw::runtime::FileStore(dir), s, sw::balance{2, 2, 2, 2},
                              sw::Checkpoint::always, true);
      CHECK(file.offloads > 0);
      check_same(plain, file);
    }
  }

  TEST_CASE("offload under CPU autocast equals the autocast step without it") {
    const auto s = sched::any_schedule("one_f_one_b", sched::one_f_one_b{});
    const auto plain =
        train(std::nullopt, s, sw::balance{2, 2, 2, 2}, sw::Checkpoint::always, false, true);
    const auto host = train(sw::runtime::HostStore(), s, sw::balance{2, 2, 2, 2},
                            sw::Checkpoint::always, false, true);
    CHECK(host.offloads > 0);
    check_same(plain, host);
  }

  TEST_CASE("without checkpointing nothing is offloaded, and the pipe trains as without a store") {
    const auto s = sched::any_schedule("one_f_one_b", sched::one_f_one_b{});
    const auto plain =
        train(std::nullopt, s, sw::balance{2, 2, 2, 2}, sw::Checkpoint::never, false);
    const auto host =
        train(sw::runtime::HostStore(), s, sw::balance{2, 2, 2, 2}, sw::Checkpoint::never, false);
    CHECK(host.offloads == 0);
    check_same(plain, host);
  }

  TEST_CASE("the file store writes a file per offloading stage, its own alone, removed after") {
    const std::string dir = temp_dir("files");
    const auto options = sw::PipeOptions().chunks(4).checkpoint(sw::Checkpoint::always);
    const auto x = torch::randn({10, 6});
    const auto t = torch::randn({10, 3});
    {
      auto pipe = sw::Pipe(
          model(), sw::balance{2, 2, 2, 2},
          sw::PipeOptions(options).offload(sw::runtime::FileStore(dir), {.costs = {.offload = 0.0}}));
      pipe->train_step(x, t, mse, sched::gpipe{});
      CHECK_FALSE(std::filesystem::exists(dir + "/stage0.offload"));  // stage 0 keeps its inputs
      for (int j = 1; j < 4; ++j) {
        CHECK(std::filesystem::exists(dir + "/stage" + std::to_string(j) + ".offload"));
      }
      // A second store over the same directory (another pipe, or another job on this machine)
      // would write the same files: refused before its step runs.
      auto other = sw::Pipe(
          model(), sw::balance{2, 2, 2, 2},
          sw::PipeOptions(options).offload(sw::runtime::FileStore(dir), {.costs = {.offload = 0.0}}));
      CHECK(contains(error_of([&] { other->train_step(x, t, mse, sched::gpipe{}); }),
                     "stagewise::FileStore('" + dir + "'): '" + dir +
                         "/stage1.offload' exists: another FileStore (another pipe, or another "
                         "job on this machine) offloads stage 1 to this directory, or a run that "
                         "crashed left it; give each pipe's store a directory of its own, or "
                         "remove the file"));
    }
    for (int j = 0; j < 4; ++j) {
      CHECK_FALSE(std::filesystem::exists(dir + "/stage" + std::to_string(j) + ".offload"));
    }
  }

  TEST_CASE(
      "file stores named for two owners (ranks) share a directory; a renamed store is refused") {
    const std::string dir = temp_dir("owners");
    const sw::runtime::StoreKey key{1, 0};
    const auto t = torch::randn({3, 2});
    sw::runtime::FileStore a(dir), b(dir);
    a.set_owner("rank0");
    b.set_owner("rank2");  // another replica's rank running the same stage
    CHECK(a.path_of(1) == dir + "/rank0.stage1.offload");
    a.begin_step({1});
    b.begin_step({1});
    a.put(key, {t});
    b.put(key, {t * 2});
    CHECK(std::filesystem::exists(dir + "/rank2.stage1.offload"));
    CHECK(a.take(key, torch::kCPU)[0].equal(t));
    CHECK(b.take(key, torch::kCPU)[0].equal(t * 2));
    a.set_owner("rank0");  // the same name again: nothing changes
    CHECK(contains(error_of([&] { a.set_owner("rank1"); }),
                   "stagewise::FileStore('" + dir +
                       "'): the store's files are named for 'rank0' and now a pipe names them "
                       "for 'rank1': one FileStore given to two pipes would mix their bytes; give "
                       "each pipe a FileStore of its own"));
    sw::runtime::FileStore c(dir);
    c.begin_step({2});
    CHECK(contains(error_of([&] { c.set_owner("rank0"); }),
                   "the store's files are open (a pipe used it)"));
    CHECK(contains(error_of([&] { sw::runtime::FileStore(dir).set_owner("a/b"); }),
                   "the owner 'a/b' cannot name a file"));
    // Through AnyStore (what PipeOptions holds and distributed::Pipe names); a store without
    // set_owner ignores it.
    sw::runtime::AnyStore any{sw::runtime::FileStore(dir)};
    any.set_owner("rank3");
    any.begin_step({1});
    CHECK(std::filesystem::exists(dir + "/rank3.stage1.offload"));
    sw::runtime::AnyStore host{sw::runtime::HostStore()};
    host.set_owner("rank3");
  }

  TEST_CASE(
      "a missing directory fails the step, naming the store and the fix; the next step is right") {
    const std::string dir = temp_dir("missing") + "/not_yet";
    torch::manual_seed(5);
    auto with = model();
    torch::manual_seed(5);
    auto without = model();
    const auto options = sw::PipeOptions().chunks(4).checkpoint(sw::Checkpoint::always);
    auto offloading = sw::Pipe(
        with, sw::balance{2, 2, 2, 2},
        sw::PipeOptions(options).offload(sw::runtime::FileStore(dir), {.costs = {.offload = 0.0}}));
    auto plain = sw::Pipe(without, sw::balance{2, 2, 2, 2}, options);
    const auto x = torch::randn({10, 6});
    const auto t = torch::randn({10, 3});
    const auto e = error_of([&] { offloading->train_step(x, t, mse, sched::one_f_one_b{}); });
    CHECK(contains(e, "stagewise::FileStore('" + dir + "'): cannot open '" + dir +
                          "/stage1.offload' for stage 1's offloaded activations (No such file or "
                          "directory); create the directory '" +
                          dir + "' and make it writable, or give FileStore a directory that is"));
    // Nothing was touched: no gradient, and after the directory exists the step is the plain one.
    for (const auto& p : with->parameters()) CHECK_FALSE(p.grad().defined());
    std::filesystem::create_directories(dir);
    torch::manual_seed(1);
    const auto a = offloading->train_step(x, t, mse, sched::one_f_one_b{});
    torch::manual_seed(1);
    const auto b = plain->train_step(x, t, mse, sched::one_f_one_b{});
    CHECK(a.item<float>() == b.item<float>());
    const auto pw = with->parameters();
    const auto pp = without->parameters();
    for (std::size_t k = 0; k < pw.size(); ++k) CHECK(pw[k].grad().equal(pp[k].grad()));
  }

  TEST_CASE("a store is checked: an empty directory name is refused with the fix") {
    CHECK(contains(error_of([] { sw::runtime::FileStore(""); }),
                   "stagewise::FileStore: the directory is empty; name the directory"));
    CHECK(contains(
        error_of([] { sw::PipeOptions().offload(sw::runtime::HostStore(), {.round_trips = -1}); }),
        "stagewise::PipeOptions: offload's round_trips is -1"));
  }
}
