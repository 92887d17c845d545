// Save and resume of the one-process pipe: a job that saves, stops and resumes in a new pipe
// trains on bit for bit as one never interrupted (parameters, buffers, optimizer state fused or
// not, random numbers); a save another pipe cannot load is refused, naming why, changing nothing.

#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
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

sw::Pipe<> pipe_of(std::uint64_t seed, sw::balance b = sw::balance{3, 4}) {
  return sw::Pipe<>(model(seed), b, sw::PipeOptions().chunks(4).checkpoint("always"));
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

// An unfused Adam, or the fused one, over a pipe's parameters.
struct Trainer {
  sw::Pipe<> pipe;
  std::unique_ptr<torch::optim::Adam> adam;
  std::unique_ptr<sw::optim::FusedStep> fused;

  Trainer(std::uint64_t seed, bool use_fused) : pipe(pipe_of(seed)) {
    if (use_fused) {
      fused = std::make_unique<sw::optim::FusedStep>(pipe->parameters(),
                                                     torch::optim::AdamOptions(1e-2));
    } else {
      adam =
          std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-2));
    }
  }
  void step(const Data& d, int s) {
    if (fused) {
      pipe->train_step(d.x[s], d.y[s], mse, *fused, sw::schedule::one_f_one_b{});
    } else {
      adam->zero_grad();
      pipe->train_step(d.x[s], d.y[s], mse, sw::schedule::one_f_one_b{});
      adam->step();
    }
  }
  void save(const fs::path& dir, int s) {
    if (fused) {
      pipe->save(dir.string(), *fused, s);
    } else {
      pipe->save(dir.string(), *adam, s);
    }
  }
  std::int64_t load(const fs::path& dir) {
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
      CHECK(fs::exists(dir / "step-1" / "stage0.pt"));
      CHECK(fs::exists(dir / "step-1" / "stage1.pt"));
      CHECK(fs::exists(dir / "step-1" / "rank0.pt"));
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

  TEST_CASE("load without an optimizer restores the parameters and buffers only") {
    const Data d = data(2);
    Trainer t(1, false);
    t.step(d, 0);
    const auto dir = scratch("params_only");
    t.save(dir, 7);
    auto other = pipe_of(3);
    CHECK(other->load(dir.string()) == 7);
    check_bit_identical(state_of(*t.pipe), state_of(*other));
  }

  TEST_CASE("a save another pipe cannot load is refused, naming why, and changes nothing") {
    const Data d = data(1);
    Trainer t(1, false);
    t.step(d, 0);
    const auto dir = scratch("refusals");
    t.save(dir / "with_optimizer", 0);
    t.pipe->save((dir / "without_optimizer").string(), 0);

    auto other = pipe_of(4, sw::balance{4, 3});
    const auto before = state_of(*other);
    CHECK(error_of([&] { other->load((dir / "with_optimizer").string()); }) ==
          "stagewise::Pipe::load: cannot load the save in " + (dir / "with_optimizer").string() +
              ": its stage 0 has {0.weight Float [8, 6]; 0.bias Float [8]; 1.weight Float [8]; "
              "1.bias Float [8]} but this pipe's has {0.weight Float [8, 6]; 0.bias Float [8]; "
              "1.weight Float [8]; 1.bias Float [8]; 3.weight Float [8, 8]; 3.bias Float [8]}; "
              "build the pipe with the model and balance that made it");
    check_bit_identical(before, state_of(*other));

    auto three = sw::Pipe<>(model(4), sw::balance{2, 2, 3}, sw::PipeOptions().chunks(4));
    CHECK(error_of([&] { three->load((dir / "with_optimizer").string()); }) ==
          "stagewise::Pipe::load: cannot load the save in " + (dir / "with_optimizer").string() +
              ": it has 2 stages but this pipe has 3; build the pipe with the model and balance "
              "that made it");

    Trainer same(5, false);
    CHECK(error_of([&] { same.load(dir / "without_optimizer"); }) ==
          "stagewise::Pipe::load: the save in " + (dir / "without_optimizer").string() +
              " has no optimizer state (it was saved without an optimizer); load it with "
              "load(dir), or resume from a save made with save(dir, optimizer, step)");
    CHECK(error_of([&] { same.load(dir / "nowhere"); }) ==
          "stagewise::Pipe::load: " + (dir / "nowhere").string() + " has no " +
              (dir / "nowhere" / "rank0.pt").string() +
              " (rank 0's part of a save): it is not a save, or the job stopped while saving; "
              "resume from an earlier save");

    // A save whose process file is missing (killed before writing it) is incomplete.
    fs::copy(dir / "with_optimizer", dir / "cut");
    fs::remove(dir / "cut" / "rank0.pt");
    CHECK(error_of([&] { same.load(dir / "cut"); }).find("has no") != std::string::npos);
  }

  TEST_CASE("a save file cut short is named, with the save and the fix, and nothing is loaded") {
    const Data d = data(1);
    Trainer t(1, false);
    t.step(d, 0);
    const auto dir = scratch("cut_files");
    t.save(dir / "whole", 0);
    Trainer other(5, false);
    const auto before = state_of(*other.pipe);
    for (const char* name : {"stage1.pt", "rank0.pt"}) {
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
}
