// Save and resume of the one-process pipe: a job that saves, stops and resumes in a new pipe,
// of the same split or another, trains on bit for bit as one never interrupted (parameters,
// buffers, optimizer state fused or not, random numbers, the scaler); a save of format 1 loads
// under the plan that made it; a save another pipe cannot load is refused, naming why, changing
// nothing.

#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/format1_save.hpp"

#include <doctest/doctest.h>

#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace fs = std::filesystem;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

// Dropout makes the steps draw random numbers, and batch norm has buffers: both must resume.
// Dropout is in one stage only: stages in one process draw from the process's generator in the
// order their threads reach it, so random layers in two stages would make even an uninterrupted
// run differ from the next.
torch::nn::Sequential model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::BatchNorm1d(8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::ReLU(),
                               torch::nn::Dropout(0.2), torch::nn::Linear(8, 3));
}

// `deferred`: batch norm's statistics of each mini-batch (DeferredBatchNorm), counted once per
// micro-batch whatever the split; plain batch norm under checkpointing counts each recompute too,
// in the order the schedule runs forwards and recomputes, which differs between splits.
sw::Pipe<> pipe_of(std::uint64_t seed, sw::balance b = sw::balance{3, 4}, bool deferred = false) {
  return sw::Pipe<>(model(seed), b,
                    sw::PipeOptions().chunks(4).checkpoint("always").deferred_batch_norm(deferred));
}

fs::path scratch(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  auto dir = fs::path(tmp ? tmp : fs::temp_directory_path().string()) /
             ("save_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  return dir;
}

struct Data {
  std::vector<torch::Tensor> x, y;
};
Data data(int steps) {
  torch::manual_seed(99);
  Data d;
  for (int s = 0; s < steps; ++s) {
    d.x.push_back(torch::randn({8, 6}));
    d.y.push_back(torch::randn({8, 3}));
  }
  return d;
}

std::vector<torch::Tensor> state_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

void check_bit_identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("tensor " << i);
    CHECK(torch::equal(a[i], b[i]));
  }
}

// An unfused Adam, or the fused one, over a pipe's parameters, with a GradScaler if asked.
struct Trainer {
  sw::Pipe<> pipe;
  std::unique_ptr<torch::optim::Adam> adam;
  std::unique_ptr<sw::optim::FusedStep> fused;
  std::unique_ptr<sw::amp::GradScaler> scaler;

  Trainer(std::uint64_t seed, bool use_fused, sw::balance b = sw::balance{3, 4},
          bool scaled = false, bool deferred = false)
      : pipe(pipe_of(seed, b, deferred)) {
    if (use_fused) {
      fused = std::make_unique<sw::optim::FusedStep>(pipe->parameters(),
                                                     torch::optim::AdamOptions(1e-2));
    } else {
      adam =
          std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-2));
    }
    // A scale that grows every other step: a resumed job must go on from the saved one.
    if (scaled) {
      scaler = std::make_unique<sw::amp::GradScaler>(
          sw::amp::GradScalerOptions().init_scale(256).growth_interval(2));
    }
  }
  void step(const Data& d, int s) {
    const sw::schedule::one_f_one_b sched;
    if (fused && scaler) {
      pipe->train_step(d.x[s], d.y[s], mse, *fused, *scaler, sched);
    } else if (fused) {
      pipe->train_step(d.x[s], d.y[s], mse, *fused, sched);
    } else {
      adam->zero_grad();
      if (scaler) {
        pipe->train_step(d.x[s], d.y[s], mse, *scaler, sched);
        scaler->step(*adam);
      } else {
        pipe->train_step(d.x[s], d.y[s], mse, sched);
        adam->step();
      }
    }
    if (scaler) scaler->update();
  }
  void save(const fs::path& dir, int s) {
    if (scaler) {
      fused ? pipe->save(dir.string(), *fused, *scaler, s)
            : pipe->save(dir.string(), *adam, *scaler, s);
    } else {
      fused ? pipe->save(dir.string(), *fused, s) : pipe->save(dir.string(), *adam, s);
    }
  }
  std::int64_t load(const fs::path& dir) {
    if (scaler) {
      return fused ? pipe->load(dir.string(), *fused, *scaler)
                   : pipe->load(dir.string(), *adam, *scaler);
    }
    return fused ? pipe->load(dir.string(), *fused) : pipe->load(dir.string(), *adam);
  }
};

}  // namespace

TEST_SUITE("save and resume") {
  TEST_CASE("a job resumed from its save trains on bit for bit as one never stopped") {
    for (const bool use_fused : {false, true}) {
      CAPTURE(use_fused);
      const Data d = data(5);
      Trainer whole(1, use_fused);
      for (int s = 0; s < 5; ++s) whole.step(d, s);

      const auto dir = scratch(use_fused ? "fused" : "unfused");
      std::vector<torch::Tensor> at_save;
      {
        Trainer first(1, use_fused);
        for (int s = 0; s < 2; ++s) first.step(d, s);
        first.save(dir / "step-1", 1);
        at_save = state_of(*first.pipe);
        first.step(d, 2);  // trained on past the save, then lost
      }
      for (const char* file : {"index.pt", "stage0.pt", "stage0.optimizer.pt", "stage1.pt",
                               "stage1.optimizer.pt", "rank0.pt"}) {
        CAPTURE(file);
        CHECK(fs::exists(dir / "step-1" / file));
      }
      torch::manual_seed(12345);      // the new job's generators are elsewhere: load restores them
      Trainer resumed(2, use_fused);  // other initial parameters: load replaces them
      CHECK(resumed.load(dir / "step-1") == 1);
      {
        INFO("right after load");
        check_bit_identical(at_save, state_of(*resumed.pipe));
      }
      for (int s = 2; s < 5; ++s) resumed.step(d, s);
      check_bit_identical(state_of(*whole.pipe), state_of(*resumed.pipe));
    }
  }

  TEST_CASE("a save loads into another split of the model, fused or not, and trains on alike") {
    // (saved by, split and fused of the resumed job, scaler): the arithmetic of each layer and
    // the order each stage accumulates its micro-batches' gradients do not depend on the split,
    // so the resumed job equals the uninterrupted one bit for bit (batch norm deferred: see
    // pipe_of).
    struct Case {
      bool saved_fused;
      sw::balance split;
      bool fused;
      bool scaled;
    };
    // (Under a scaler the fused step runs each step's forward twice, which a batch norm counts:
    // fused and unfused are compared without one.)
    const Case cases[] = {{false, {2, 2, 3}, true, false},
                          {true, {7}, true, true},
                          {false, {1, 1, 2, 3}, false, true},
                          {true, {6, 1}, false, false}};
    for (const auto& c : cases) {
      CAPTURE(c.split.size());
      CAPTURE(c.fused);
      const Data d = data(5);
      Trainer whole(1, c.saved_fused, sw::balance{3, 4}, c.scaled, true);
      for (int s = 0; s < 5; ++s) whole.step(d, s);
      const auto dir = scratch("split_" + std::to_string(c.split.size()));
      {
        Trainer first(1, c.saved_fused, sw::balance{3, 4}, c.scaled, true);
        for (int s = 0; s < 2; ++s) first.step(d, s);
        first.save(dir, 1);
      }
      torch::manual_seed(12345);
      Trainer resumed(2, c.fused, c.split, c.scaled, true);
      CHECK(resumed.load(dir) == 1);
      for (int s = 2; s < 5; ++s) resumed.step(d, s);
      check_bit_identical(state_of(*whole.pipe), state_of(*resumed.pipe));
      if (c.scaled) CHECK(whole.scaler->get_scale() == resumed.scaler->get_scale());
    }
  }

  TEST_CASE("load without an optimizer restores the parameters and buffers only") {
    const Data d = data(2);
    Trainer t(1, false);
    t.step(d, 0);
    const auto dir = scratch("params_only");
    t.save(dir, 7);
    auto other = pipe_of(3, sw::balance{5, 2});
    CHECK(other->load(dir.string()) == 7);
    check_bit_identical(state_of(*t.pipe), state_of(*other));
  }

  TEST_CASE("a typed stage list saves its stages as layers and loads them back") {
    auto typed = [](std::uint64_t seed) {
      torch::manual_seed(seed);
      return sw::Pipe(sw::stages(torch::nn::Linear(4, 5), torch::nn::Linear(5, 2)),
                      sw::PipeOptions().chunks(2));
    };
    auto a = typed(1);
    torch::optim::SGD sgd(a->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    a->train_step(torch::randn({4, 4}), torch::randn({4, 2}), mse);
    sgd.step();
    const auto dir = scratch("typed");
    a->save(dir.string(), sgd, 3);
    auto b = typed(2);
    torch::optim::SGD other(b->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    CHECK(b->load(dir.string(), other) == 3);
    check_bit_identical(state_of(*a), state_of(*b));
    CHECK(other.state().size() == 4);
    // A Sequential of the same layers names them alike ("0.weight", ... "1.bias").
    torch::manual_seed(3);
    auto seq = sw::Pipe<>(torch::nn::Sequential(torch::nn::Linear(4, 5), torch::nn::Linear(5, 2)),
                          sw::balance{1, 1}, sw::PipeOptions().chunks(2));
    CHECK(seq->load(dir.string()) == 3);
    check_bit_identical(state_of(*a), state_of(*seq));
  }

  TEST_CASE("a save of another model is refused, naming the first difference, changing nothing") {
    const Data d = data(1);
    Trainer t(1, false);
    t.step(d, 0);
    const auto dir = scratch("other_model");
    t.save(dir, 0);
    const std::string start = "stagewise::Pipe::load: cannot load the save in " + dir.string() +
                              ": it is a save of another model: ";
    const std::string fix =
        "; build the model that made it (its layers, their parameters and buffers)";
    auto refused = [&](torch::nn::Sequential seq, sw::balance b, const std::string& why) {
      auto other = sw::Pipe<>(seq, b, sw::PipeOptions().chunks(2));
      torch::optim::Adam adam(other->parameters(), torch::optim::AdamOptions(1e-2));
      const auto before = state_of(*other);
      CHECK(error_of([&] { other->load(dir.string(), adam); }) == start + why + fix);
      check_bit_identical(before, state_of(*other));
    };
    using namespace torch::nn;
    refused(Sequential(Linear(6, 8), BatchNorm1d(8), Tanh(), Linear(8, 5), ReLU(), Dropout(0.2),
                       Linear(5, 3)),
            sw::balance{3, 4},
            "it holds '3.weight' as Float [8, 8] where this model has Float [5, 8]");
    refused(Sequential(Linear(6, 8), BatchNorm1d(8), Tanh(), Linear(8, 8), ReLU(), Dropout(0.2),
                       Linear(8, 3), Linear(3, 3)),
            sw::balance{4, 4}, "it holds no '7.weight' (Float [3, 3]), which this model has");
    refused(Sequential(Linear(6, 8), BatchNorm1d(8), Tanh(), Linear(8, 8)), sw::balance{2, 2},
            "it holds '6.weight' (Float [3, 8]), which this model lacks");
    refused(Sequential(Linear(6, 8), Tanh(), BatchNorm1d(8), Linear(8, 8), ReLU(), Dropout(0.2),
                       Linear(8, 3)),
            sw::balance{3, 4}, "it holds no '2.weight' (Float [8]), which this model has");
    refused(Sequential(Linear(6, 8), BatchNorm1d(8), Tanh(), Linear(8, 8), ReLU(), Dropout(0.2),
                       Linear(8, 3), ReLU()),
            sw::balance{4, 4}, "its model has 7 layers and this one 8");
  }

  TEST_CASE("another optimizer, a save without optimizer state, an incomplete or newer save are "
            "refused, changing nothing") {
    const Data d = data(1);
    Trainer t(1, false);
    t.step(d, 0);
    const auto dir = scratch("refusals");
    t.save(dir / "with_optimizer", 0);
    t.pipe->save((dir / "without_optimizer").string(), 0);
    const std::string where = "stagewise::Pipe::load: ";

    auto other = pipe_of(4, sw::balance{4, 3});
    const auto before = state_of(*other);
    torch::optim::SGD sgd(other->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    CHECK(error_of([&] { other->load((dir / "with_optimizer").string(), sgd); }) ==
          where + "the save in " + (dir / "with_optimizer").string() +
              " holds the state of torch::optim::AdamOptions but this optimizer keeps "
              "torch::optim::SGDOptions; resume with the optimizer that made it (fused or not)");
    CHECK(sgd.state().empty());
    check_bit_identical(before, state_of(*other));

    Trainer same(5, false);
    CHECK(error_of([&] { same.load(dir / "without_optimizer"); }) ==
          where + "the save in " + (dir / "without_optimizer").string() +
              " has no optimizer state (it was saved without an optimizer); load it with "
              "load(dir), or resume from a save made with save(dir, optimizer, step)");
    CHECK(error_of([&] { same.load(dir / "nowhere"); }) ==
          where + (dir / "nowhere").string() + " has no " +
              (dir / "nowhere" / "index.pt").string() +
              ": it is not a save, or the job stopped while saving; resume from an earlier save");

    // A save whose index is missing (the job was killed before writing it) is incomplete.
    fs::copy(dir / "with_optimizer", dir / "cut");
    fs::remove(dir / "cut" / "index.pt");
    CHECK(error_of([&] { same.load(dir / "cut"); }) ==
          where + (dir / "cut").string() + " has no " + (dir / "cut" / "index.pt").string() +
              ": the job stopped while saving; resume from an earlier save");
    // A file the index needs is missing.
    fs::copy(dir / "with_optimizer", dir / "lost");
    fs::remove(dir / "lost" / "stage1.optimizer.pt");
    CHECK(error_of([&] { same.load(dir / "lost"); }) ==
          where + (dir / "lost").string() + " has no " +
              (dir / "lost" / "stage1.optimizer.pt").string() +
              " (optimizer state of its stage 1): the save is incomplete, or not all its files "
              "are here (a save loads under another plan where every process sees all its "
              "files: a file system they share, or a copy of the whole save on each machine)");

    // A newer stagewise's save: its format is named.
    for (const char* file : {"index.pt", "rank0.pt"}) {
      CAPTURE(file);
      const auto newer = dir / (std::string("newer_") + file);
      fs::create_directories(newer);
      torch::serialize::OutputArchive a;
      a.write("format", c10::IValue(std::int64_t{3}));
      a.save_to((newer / file).string());
      CHECK(error_of([&] { same.load(newer); }) ==
            where + (newer / file).string() +
                " has save format 3; this stagewise reads formats 1 to 2: load it with the "
                "stagewise that wrote it, or a newer one");
    }
  }

  TEST_CASE("a save file cut short is named, with the save and the fix, and nothing is loaded") {
    const Data d = data(1);
    Trainer t(1, false);
    t.step(d, 0);
    const auto dir = scratch("cut_files");
    t.save(dir / "whole", 0);
    Trainer other(5, false, sw::balance{2, 5});
    const auto before = state_of(*other.pipe);
    for (const char* name : {"index.pt", "stage1.pt", "stage1.optimizer.pt", "rank0.pt"}) {
      CAPTURE(name);
      const auto save = dir / (std::string("cut_") + name);
      fs::copy(dir / "whole", save);
      fs::resize_file(save / name, fs::file_size(save / name) / 2);
      const auto e = error_of([&] { other.load(save); });
      const std::string start = "stagewise::Pipe::load: could not read " + (save / name).string() +
                                " of the save in " + save.string() + ": ";
      CHECK(e.rfind(start, 0) == 0);
      CHECK(contains(e, ". The file is damaged or cut short (a job killed while writing it, a "
                        "full disk); resume from the previous save"));
      check_bit_identical(before, state_of(*other.pipe));
    }
  }

  TEST_CASE("a save of format 1 loads under the plan that made it; under another, it is refused "
            "naming the fix") {
    const Data d = data(5);
    Trainer whole(1, false);
    for (int s = 0; s < 5; ++s) whole.step(d, s);
    const auto dir = scratch("format1");
    {
      Trainer first(1, false);
      for (int s = 0; s < 2; ++s) first.step(d, s);
      sw::testing::write_format1_save(first.pipe, *first.adam, (dir / "old").string(), 1);
    }
    Trainer elsewhere(2, false, sw::balance{2, 2, 3});
    CHECK(error_of([&] { elsewhere.load(dir / "old"); }) ==
          "stagewise::Pipe::load: cannot load the save in " + (dir / "old").string() +
              " (save format 1, which loads only under the plan that made it): it has 2 stages "
              "but this pipe has 3; build the pipe with the model and balance that made it; or "
              "load it with the pipe that made it and save it again: a save of format 2 loads "
              "under any plan");
    torch::manual_seed(12345);
    Trainer resumed(2, false);
    CHECK(resumed.load(dir / "old") == 1);
    resumed.step(d, 2);
    resumed.save(dir / "new", 2);  // format 2: it loads into the other split
    for (int s = 3; s < 5; ++s) resumed.step(d, s);
    check_bit_identical(state_of(*whole.pipe), state_of(*resumed.pipe));
    // (after `resumed` finished: the two draw dropout's numbers from one generator)
    CHECK(elsewhere.load(dir / "new") == 2);
    for (int s = 3; s < 5; ++s) elsewhere.step(d, s);
    const auto a = state_of(*whole.pipe), b = state_of(*elsewhere.pipe);
    // The parameters: the batch norm's running statistics differ between splits (pipe_of).
    check_bit_identical({a.begin(), a.begin() + 8}, {b.begin(), b.begin() + 8});
  }

  TEST_CASE("latest_save picks the complete save of the highest step; read_save_info reads one") {
    const Data d = data(1);
    Trainer t(1, false);
    t.step(d, 0);
    const auto root = scratch("latest");
    t.save(root / "a", 1);
    t.save(root / "b", 3);
    t.save(root / "c", 5);
    fs::remove(root / "c" / "index.pt");  // killed while saving: incomplete
    sw::testing::write_format1_save(t.pipe, *t.adam, (root / "d").string(), 4);
    fs::create_directories(root / "notes");
    std::ofstream(root / "notes" / "index.pt") << "not a save";

    auto last = sw::latest_save(root.string());
    REQUIRE(last.has_value());
    CHECK(last->dir == (root / "d").string());
    CHECK(last->step == 4);
    CHECK(last->format == 1);
    CHECK(last->stages == 2);
    fs::remove(root / "d" / "rank0.pt");
    last = sw::latest_save(root.string());
    REQUIRE(last.has_value());
    CHECK(last->dir == (root / "b").string());
    CHECK(last->step == 3);
    CHECK(last->format == 2);
    CHECK(last->processes == 1);
    CHECK(last->replicas == 1);
    CHECK(last->stages == 2);
    CHECK_FALSE(sw::read_save_info((root / "c").string()).has_value());
    CHECK_FALSE(sw::read_save_info((root / "notes").string()).has_value());
    CHECK_FALSE(sw::latest_save((root / "nowhere").string()).has_value());
  }
}
