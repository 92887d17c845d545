// PipeOptions().optimizer_offload: a pipe whose optimizer state is off the device (a HostStore, a
// FileStore, the activations' store too) trains exactly as the same pipe without it, over every
// schedule and checkpoint mode, fused and unfused, Adam and SGD with momentum, each step clipped
// by the whole model's norm under a GradScaler that skips one; saves resume with it on or off.
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/pipe_layers.hpp"

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

// Eight layers with a skip from layer 1 to layer 5 (across stages) and dropout.
torch::nn::Sequential model() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(6, 16), sw::testing::Stash(), torch::nn::Tanh(),
                               torch::nn::Dropout(0.2), torch::nn::Linear(16, 16),
                               sw::testing::Pop(), torch::nn::Tanh(), torch::nn::Linear(16, 3));
}

std::string temp_dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(base ? base : "/tmp") + "/stagewise_state_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// The loss, made infinite on the step that `poison` names (a GradScaler then skips it).
struct Loss {
  std::shared_ptr<bool> poison = std::make_shared<bool>(false);
  torch::Tensor operator()(const torch::Tensor& out, const torch::Tensor& target) const {
    auto l = torch::mse_loss(out, target);
    return *poison ? l * std::numeric_limits<float>::infinity() : l;
  }
};

struct Setting {
  sched::any_schedule schedule{"gpipe", sched::gpipe{}};
  sw::balance balance{2, 2, 2, 2};
  sw::Checkpoint mode = sw::Checkpoint::always;
  bool fused = true;
  bool adam = true;
};

struct Trained {
  std::vector<torch::Tensor> parameters;
  std::vector<float> losses;
  bool skip_kept_parameters = true;  // the skipped step changed nothing
  std::size_t offloaded = 0;         // parameters whose state was off the device
};

std::vector<torch::Tensor> values(const sw::Pipe<>& pipe) {
  std::vector<torch::Tensor> out;
  for (const auto& p : pipe->parameters()) out.push_back(p.detach().clone());
  return out;
}

// Three steps of `s`, each clipped to a norm of 0.05 under a GradScaler; the second overflows
// and is skipped. `options` adds the optimizer offload (or not).
Trained train(const Setting& s, sw::PipeOptions options) {
  auto m = model();
  options.chunks(8).checkpoint(s.mode);
  auto pipe = sw::Pipe(m, s.balance, options);
  const auto factory =
      s.adam ? sw::optim::make_optimizer_factory(torch::optim::AdamOptions(0.01))
             : sw::optim::make_optimizer_factory(torch::optim::SGDOptions(0.1).momentum(0.9));
  std::optional<sw::optim::FusedStep> fused;
  std::unique_ptr<torch::optim::Optimizer> unfused;
  if (s.fused) {
    fused.emplace(pipe->named_parameters(), factory);
  } else if (options.optimizer_store()) {
    unfused = std::make_unique<sw::optim::OffloadedOptimizer>(pipe->named_parameters(), factory,
                                                              pipe->offloaded_state());
  } else {
    unfused = factory(pipe->parameters());
  }
  sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().init_scale(256.0));
  Loss loss;
  Trained out;
  torch::manual_seed(9);
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({16, 6});
    const auto t = torch::randn({16, 3});
    *loss.poison = step == 1;
    const auto before = values(pipe);
    if (fused) {
      torch::Tensor l;
      pipe->clip_grad_norm_step(
          *fused, [&] { l = pipe->train_step(x, t, loss, *fused, scaler, s.schedule); }, 0.05,
          scaler);
      out.losses.push_back(l.item<float>());
    } else {
      out.losses.push_back(pipe->train_step(x, t, loss, scaler, s.schedule).item<float>());
      scaler.unscale_(*unfused);
      torch::nn::utils::clip_grad_norm_(pipe->parameters(), 0.05);
      scaler.step(*unfused);
      for (auto& p : pipe->parameters()) p.mutable_grad().reset();
    }
    scaler.update();
    if (step == 1) {
      const auto after = values(pipe);
      for (std::size_t k = 0; k < after.size(); ++k) {
        out.skip_kept_parameters = out.skip_kept_parameters && torch::equal(after[k], before[k]);
      }
    }
  }
  out.parameters = values(pipe);
  if (fused) {
    for (std::size_t i = 0; i < fused->size(); ++i) out.offloaded += fused->offloaded(i);
  } else if (auto* o = dynamic_cast<sw::optim::OffloadedOptimizer*>(unfused.get())) {
    for (std::size_t i = 0; i < pipe->parameters().size(); ++i) out.offloaded += o->offloaded(i);
  }
  return out;
}

void check_same(const Trained& a, const Trained& b) {
  CHECK(a.losses == b.losses);
  CHECK(a.skip_kept_parameters);
  CHECK(b.skip_kept_parameters);
  REQUIRE(a.parameters.size() == b.parameters.size());
  for (std::size_t k = 0; k < a.parameters.size(); ++k) {
    CHECK(a.parameters[k].equal(b.parameters[k]));
  }
}

std::vector<std::pair<sched::any_schedule, sw::balance>> every_schedule() {
  const sw::balance v{1, 1, 1, 1, 1, 1, 1, 1};
  return {
      {sched::any_schedule("gpipe", sched::gpipe{}), sw::balance{2, 2, 2, 2}},
      {sched::any_schedule("one_f_one_b", sched::one_f_one_b{}), sw::balance{2, 2, 2, 2}},
      {sched::any_schedule("zero_bubble_h1", sched::zero_bubble_h1{}), sw::balance{2, 2, 2, 2}},
      {sched::any_schedule("interleaved{2}", sched::interleaved_one_f_one_b{2}), v},
      {sched::any_schedule("zero_bubble_v", sched::zero_bubble_v{}), v},
      {sched::any_schedule("v_half", sched::v_half{}), v},
      {sched::any_schedule("v_min", sched::v_min{}), v},
      {sched::any_schedule("dualpipe_v", sched::dualpipe_v{}), v},
  };
}

}  // namespace

TEST_SUITE("optimizer state off the device, in a pipe") {
  TEST_CASE("every schedule x checkpoint mode, fused and unfused, Adam and SGD: bit for bit") {
    const std::string dir = temp_dir("matrix");
    for (const auto& [schedule, balance] : every_schedule()) {
      for (auto mode :
           {sw::Checkpoint::always, sw::Checkpoint::except_last, sw::Checkpoint::never}) {
        for (bool fused : {true, false}) {
          for (bool adam : {true, false}) {
            CAPTURE(schedule.name());
            CAPTURE(sw::to_string(mode));
            CAPTURE(fused);
            CAPTURE(adam);
            const Setting s{schedule, balance, mode, fused, adam};
            // Adam's state all in host memory; SGD's momentum in files, a share per stage.
            auto offloaded =
                adam ? sw::PipeOptions().optimizer_offload(sw::runtime::HostStore())
                     : sw::PipeOptions().optimizer_offload(
                           sw::runtime::FileStore(dir), std::vector<double>(balance.size(), 0.5));
            const auto with = train(s, offloaded);
            CHECK(with.offloaded > 0);
            check_same(train(s, sw::PipeOptions()), with);
          }
        }
      }
    }
  }

  TEST_CASE("one store holds the activations and the optimizer state") {
    const std::string dir = temp_dir("one_store");
    sw::runtime::AnyStore store(sw::runtime::FileStore{dir});
    for (bool fused : {true, false}) {
      CAPTURE(fused);
      const Setting s{sched::any_schedule("one_f_one_b", sched::one_f_one_b{}),
                      sw::balance{2, 2, 2, 2}, sw::Checkpoint::always, fused, true};
      const auto plain = train(s, sw::PipeOptions());
      const auto both = train(s, sw::PipeOptions()
                                     .offload(store, {.costs = {.offload = 0.0}})
                                     .optimizer_offload(store, 1.0));
      CHECK(both.offloaded == 6);  // every parameter (three Linear layers)
      check_same(plain, both);
    }
  }

  TEST_CASE("a save resumes bit for bit with the offload turned on or off, under another split") {
    // Two steps, a save, then two more in a new pipe (split {4, 4}, or {2, 6} after): every way
    // round equals four steps without offload. Fused: the FusedStep takes the pipe's offload at
    // its first train_step, after the load (the loaded state moves into the store); unfused: a
    // plain Adam, or an optim::OffloadedOptimizer bound to pipe->offloaded_state().
    const std::string dir = temp_dir("saves");
    auto x = torch::randn({16, 6}), t = torch::randn({16, 3});
    const auto adam = torch::optim::AdamOptions(0.01);
    auto options = [&](bool on) {
      auto o = sw::PipeOptions().chunks(4);
      if (on) o.optimizer_offload(sw::runtime::FileStore(dir), 0.5);
      return o;
    };
    // Steps `from` to `to` of a pipe over a fresh model split by `b`, loading `load` first and
    // saving to `save` at the end (either may be empty); the parameters after.
    auto run = [&](bool fused, bool offload, const sw::balance& b, const std::string& load,
                   const std::string& save, int from, int to) {
      auto m = model();
      auto pipe = sw::Pipe(m, b, options(offload));
      std::optional<sw::optim::FusedStep> f;
      std::unique_ptr<torch::optim::Optimizer> u;
      if (fused) {
        f.emplace(pipe->named_parameters(), adam);
      } else if (offload) {
        u = std::make_unique<sw::optim::OffloadedOptimizer>(pipe->named_parameters(), adam,
                                                            pipe->offloaded_state());
      } else {
        u = std::make_unique<torch::optim::Adam>(pipe->parameters(), adam);
      }
      if (!load.empty()) CHECK((f ? pipe->load(load, *f) : pipe->load(load, *u)) == from);
      if (load.empty()) torch::manual_seed(3);
      for (int step = from; step < to; ++step) {
        if (f) {
          pipe->train_step(x, t, Loss{}, *f);
        } else {
          pipe->train_step(x, t, Loss{});
          u->step();
          for (auto& p : pipe->parameters()) p.mutable_grad().reset();
        }
      }
      if (!save.empty()) {
        if (f) {
          pipe->save(save, *f, to);
        } else {
          pipe->save(save, *u, to);
        }
      }
      return values(pipe);
    };
    for (bool fused : {true, false}) {
      const auto want = run(fused, false, sw::balance{4, 4}, "", "", 0, 4);
      for (bool before : {false, true}) {
        for (bool after : {false, true}) {
          CAPTURE(fused);
          CAPTURE(before);
          CAPTURE(after);
          const std::string save = dir + "/save_" + std::to_string(fused) + std::to_string(before) +
                                   std::to_string(after);
          (void)run(fused, before, sw::balance{4, 4}, "", save, 0, 2);
          const auto got =
              run(fused, after, after ? sw::balance{2, 6} : sw::balance{4, 4}, save, "", 2, 4);
          for (std::size_t k = 0; k < got.size(); ++k) CHECK(torch::equal(got[k], want[k]));
        }
      }
    }
  }

  TEST_CASE("what the pipe refuses, naming the fix") {
    auto m = model();
    CHECK(contains(error_of([&] {
                     (void)sw::Pipe(m, sw::balance{4, 4},
                                    sw::PipeOptions().optimizer_offload(sw::runtime::HostStore(),
                                                                        {0.5, 0.5, 0.5}));
                   }),
                   "stagewise::Pipe: optimizer_offload gives 3 shares for a pipe of 2 stages; "
                   "give one share per stage, or one for all"));
    CHECK(contains(
        error_of([] { (void)sw::PipeOptions().optimizer_offload(sw::runtime::HostStore(), 2.0); }),
        "optimizer_offload's share is 2; give a share of a stage's parameter bytes "
        "from 0 (none) to 1 (all)"));
    auto pipe = sw::Pipe(m, sw::balance{4, 4}, sw::PipeOptions());
    CHECK(contains(error_of([&] { (void)pipe->offloaded_state(); }),
                   "stagewise::Pipe::offloaded_state: the pipe keeps the optimizer's state on the "
                   "device; give PipeOptions().optimizer_offload(store, share) to keep it off"));
  }
}
