// train_step under amp::GradScaler: in every schedule and checkpoint mode each micro-batch's loss
// is scaled before its backward, the loss returned is not, and the gradients equal the
// unpipelined model's under the same scaler bit for bit; the fused step under the scaler equals
// the scaler with the unfused optimizer (with and without clipping, overflows injected) on the
// pipe and on the unpipelined model; a save with the scaler resumes bit for bit.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include <torch/torch.h>

#include "tests/support/autocast.hpp"
#include "tests/support/errors.hpp"
#include "tests/support/schedule_fixture.hpp"

#include <doctest/doctest.h>

#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <typeinfo>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::error_of;
using sw::testing::grads_of;
using sw::testing::mlp;
using sw::testing::mse;

namespace {

using Loss = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;

// The unpipelined step under `scaler`: reference_step with scaler.scale(loss_i * w_i).backward().
torch::Tensor scaled_reference(torch::nn::SequentialImpl& seq, const torch::Tensor& x,
                               const torch::Tensor& t, int chunks, bool ascending,
                               sw::amp::GradScaler& scaler, const Loss& loss = mse) {
  auto xs = x.chunk(chunks), ts = t.chunk(chunks);
  std::vector<torch::Tensor> losses;
  torch::Tensor total;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double w = static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0));
    losses.push_back(loss(seq.forward(xs[i]), ts[i]) * w);
    total = total.defined() ? total + losses.back().detach() : losses.back().detach();
  }
  if (!ascending) std::reverse(losses.begin(), losses.end());
  for (auto& l : losses) scaler.scale(l).backward();
  return total;
}

// One step of `s` with a scaler on the pipe and on the unpipelined model, in every mode: equal
// losses (unscaled) and gradients (scaled), bit for bit.
template <class Schedule>
void check_scaled_grads(const Schedule& s, const sw::balance& b, bool ascending) {
  for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
    CAPTURE(sw::to_string(mode));
    CAPTURE(typeid(Schedule).name());
    torch::manual_seed(3);
    auto seq = mlp(0.2);
    const auto x = torch::randn({10, 6}), t = torch::randn({10, 3});
    sw::amp::GradScaler ref_scaler, scaler;
    torch::manual_seed(5);
    const auto expected_loss = scaled_reference(*seq, x, t, 4, ascending, ref_scaler);
    const auto expected = grads_of(*seq);
    torch::manual_seed(5);
    const auto unscaled = sw::testing::reference_step(*seq, x, t, 4, ascending);  // for the check
    for (auto& p : seq->parameters()) p.mutable_grad().reset();
    auto pipe = sw::Pipe(seq, b, sw::PipeOptions().chunks(4).checkpoint(mode));
    torch::manual_seed(5);
    const torch::Tensor loss = pipe->train_step(x, t, mse, scaler, s);
    CHECK(loss.item<float>() == expected_loss.item<float>());
    CHECK(loss.item<float>() == unscaled.item<float>());  // the loss returned is not scaled
    const auto got = grads_of(*seq);
    REQUIRE(got.size() == expected.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      CAPTURE(k);
      CHECK(got[k].equal(expected[k]));
    }
    CHECK(got.front().abs().max().item<float>() > 100.f);  // scaled by 2^16
  }
}

const float kInf = std::numeric_limits<float>::infinity();

// The loss of a step: at the bad steps it overflows (inf gradients all the way back).
Loss loss_at(int step, const std::set<int>& bad) {
  return [bad = bad.count(step) > 0](const torch::Tensor& o, const torch::Tensor& t) {
    auto l = torch::mse_loss(o, t);
    return bad ? l + o.sum() * kInf : l;
  };
}

// Training with a scaler: the fused AdamW on a pipe, the unfused one on a pipe and on the
// unpipelined model; with max_norm, clipped (the fused by pipe->clip_grad_norm_step).
struct Trained {
  torch::nn::Sequential seq;
  std::vector<double> scales{};
  std::vector<bool> stepped{};
};

const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
const std::set<int> kBad = {1, 4, 5};
constexpr int kSteps = 8;

std::pair<torch::Tensor, torch::Tensor> batch(int s) {
  torch::manual_seed(700 + s);
  return {torch::randn({10, 6}) * 3, torch::randn({10, 3})};
}

sw::amp::GradScaler scaler_for_test() {
  return sw::amp::GradScaler(sw::amp::GradScalerOptions().init_scale(256).growth_interval(2));
}

template <class Schedule>
Trained fused_pipe(const Schedule& s, const sw::balance& b, std::optional<double> max_norm) {
  torch::manual_seed(3);
  Trained r{mlp()};
  auto pipe = sw::Pipe(r.seq, b, sw::PipeOptions().chunks(4));
  sw::optim::FusedStep fused(pipe->parameters(), adamw);
  auto scaler = scaler_for_test();
  for (int step = 0; step < kSteps; ++step) {
    auto [x, t] = batch(step);
    const auto f = loss_at(step, kBad);
    if (max_norm) {
      r.stepped.push_back(pipe->clip_grad_norm_step(
                                  fused, [&] { pipe->train_step(x, t, f, fused, scaler, s); },
                                  *max_norm, scaler)
                              .stepped);
    } else {
      const auto before = r.seq->parameters().front().detach().clone();
      pipe->train_step(x, t, f, fused, scaler, s);
      r.stepped.push_back(!torch::equal(before, r.seq->parameters().front()));
    }
    scaler.update();
    r.scales.push_back(scaler.get_scale());
  }
  return r;
}

// The unfused step after scaled gradients (from the pipe or the unpipelined model).
void unfused_step(torch::nn::Module& m, torch::optim::AdamW& opt, sw::amp::GradScaler& scaler,
                  std::optional<double> max_norm, Trained& r) {
  if (max_norm) {
    scaler.unscale_(opt);
    torch::nn::utils::clip_grad_norm_(m.parameters(), *max_norm);
  }
  r.stepped.push_back(scaler.step(opt));
  scaler.update();
  r.scales.push_back(scaler.get_scale());
  for (auto& p : m.parameters()) p.mutable_grad().reset();
}

template <class Schedule>
Trained unfused_pipe(const Schedule& s, const sw::balance& b, std::optional<double> max_norm) {
  torch::manual_seed(3);
  Trained r{mlp()};
  auto pipe = sw::Pipe(r.seq, b, sw::PipeOptions().chunks(4));
  torch::optim::AdamW opt(pipe->parameters(), adamw);
  auto scaler = scaler_for_test();
  for (int step = 0; step < kSteps; ++step) {
    auto [x, t] = batch(step);
    pipe->train_step(x, t, loss_at(step, kBad), scaler, s);
    unfused_step(*pipe, opt, scaler, max_norm, r);
  }
  return r;
}

Trained unpipelined(std::optional<double> max_norm) {
  torch::manual_seed(3);
  Trained r{mlp()};
  torch::optim::AdamW opt(r.seq->parameters(), adamw);
  auto scaler = scaler_for_test();
  for (int step = 0; step < kSteps; ++step) {
    auto [x, t] = batch(step);
    scaled_reference(*r.seq, x, t, 4, /*ascending=*/true, scaler, loss_at(step, kBad));
    unfused_step(*r.seq, opt, scaler, max_norm, r);
  }
  return r;
}

void check_same(const Trained& a, const Trained& b) {
  CHECK(a.scales == b.scales);
  CHECK(a.stepped == b.stepped);
  const auto pa = a.seq->parameters(), pb = b.seq->parameters();
  for (std::size_t k = 0; k < pa.size(); ++k) {
    CAPTURE(k);
    CHECK(torch::equal(pa[k], pb[k]));
  }
}

template <class Schedule>
void check_fused(const Schedule& s, const sw::balance& b) {
  const auto plain = unpipelined(std::nullopt), clipped = unpipelined(0.05);
  for (int k = 0; k < kSteps; ++k) CHECK(plain.stepped[k] == (kBad.count(k) == 0));
  check_same(unfused_pipe(s, b, std::nullopt), plain);
  check_same(fused_pipe(s, b, std::nullopt), plain);
  check_same(unfused_pipe(s, b, 0.05), clipped);
  check_same(fused_pipe(s, b, 0.05), clipped);
}

std::filesystem::path scratch(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  auto dir = std::filesystem::path(tmp ? tmp : "/tmp") /
             ("scaled_train_" + std::to_string(::getpid())) / name;
  std::filesystem::remove_all(dir);
  return dir;
}

// Whether this LibTorch autocasts the CPU to fp16 (2.x; 1.13 refuses the dtype).
bool cpu_fp16_autocast() {
  try {
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
    at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
#else
    at::autocast::set_autocast_cpu_dtype(at::kHalf);
    at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
#endif
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

TEST_SUITE("train_step under a GradScaler") {
  TEST_CASE("every schedule scales each micro-batch's loss as scaler.scale(loss).backward()") {
    check_scaled_grads(sched::gpipe{}, sw::balance{3, 5}, false);
    check_scaled_grads(sched::one_f_one_b{}, sw::balance{3, 5}, true);
    check_scaled_grads(sched::interleaved_one_f_one_b{2}, sw::balance{2, 2, 2, 2}, true);
    check_scaled_grads(sched::zero_bubble_h1{}, sw::balance{3, 5}, true);
    check_scaled_grads(sched::zero_bubble_v{}, sw::balance{2, 2, 2, 2}, true);
    check_scaled_grads(sched::v_half{}, sw::balance{1, 1, 1, 1, 1, 1, 1, 1}, true);
  }

  TEST_CASE("fused = unfused = unpipelined under 1F1B, with and without clipping, overflows") {
    check_fused(sched::one_f_one_b{}, sw::balance{3, 5});
  }
  TEST_CASE("fused = unfused = unpipelined under ZB-H1 (split backward) and ZB-V") {
    check_fused(sched::zero_bubble_h1{}, sw::balance{3, 5});
    check_fused(sched::zero_bubble_v{}, sw::balance{2, 2, 2, 2});
  }

  TEST_CASE("bf16 autocast with a scaler: fp32 gradients, scaled, as the unpipelined model's") {
    torch::manual_seed(3);
    auto seq = mlp();
    const auto x = torch::randn({8, 6}), t = torch::randn({8, 3});
    sw::amp::GradScaler ref_scaler, scaler;
    const Loss f = [](const torch::Tensor& o, const torch::Tensor& y) {
      return torch::mse_loss(o.to(torch::kFloat), y);
    };
    {
      sw::testing::CpuAutocastRegion region;
      scaled_reference(*seq, x, t, 4, false, ref_scaler, f);
    }
    const auto expected = grads_of(*seq);
    for (auto& p : seq->parameters()) p.mutable_grad().reset();
    auto pipe = sw::Pipe(seq, sw::balance{3, 5}, sw::PipeOptions().chunks(4).checkpoint("always"));
    {
      sw::testing::CpuAutocastRegion region;
      pipe->train_step(x, t, f, scaler);
    }
    const auto got = grads_of(*seq);
    for (std::size_t k = 0; k < got.size(); ++k) {
      CHECK(got[k].dtype() == torch::kFloat);
      CHECK(got[k].equal(expected[k]));
    }
  }

  TEST_CASE("fp16 CPU autocast with a scaler, where this LibTorch has it (2.x)") {
    if (!cpu_fp16_autocast()) {
      MESSAGE("this LibTorch (" << TORCH_VERSION << ") has no fp16 CPU autocast: not run");
      return;
    }
    torch::manual_seed(3);
    auto seq = mlp();
    const auto x = torch::randn({8, 6}), t = torch::randn({8, 3});
    sw::amp::GradScaler ref_scaler, scaler;
    const Loss f = [](const torch::Tensor& o, const torch::Tensor& y) {
      return torch::mse_loss(o.to(torch::kFloat), y);
    };
    auto fp16 = [&](auto&& body) {
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
      at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
#else
      at::autocast::set_autocast_cpu_dtype(at::kHalf);
#endif
      {
        sw::testing::CpuAutocastRegion region;
        body();
      }
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
#else
      at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
#endif
    };
    fp16([&] { scaled_reference(*seq, x, t, 4, false, ref_scaler, f); });
    const auto expected = grads_of(*seq);
    for (auto& p : seq->parameters()) p.mutable_grad().reset();
    auto pipe = sw::Pipe(seq, sw::balance{3, 5}, sw::PipeOptions().chunks(4).checkpoint("always"));
    fp16([&] { pipe->train_step(x, t, f, scaler); });
    const auto got = grads_of(*seq);
    for (std::size_t k = 0; k < got.size(); ++k) CHECK(got[k].equal(expected[k]));
    torch::optim::SGD a(seq->parameters(), torch::optim::SGDOptions(0.1));
    CHECK(scaler.step(a));
  }

  TEST_CASE("a save with the scaler resumes in new objects bit for bit; one without is refused") {
    const auto dir = scratch("resume");
    auto run = [&](int from, int to, std::optional<int> save_at, bool load) {
      torch::manual_seed(load ? 99 : 3);  // a resumed run starts elsewhere: load replaces it
      auto seq = mlp(0.2);
      auto pipe = sw::Pipe(seq, sw::balance{3, 5}, sw::PipeOptions().chunks(4).checkpoint("always"));
      torch::optim::AdamW opt(pipe->parameters(), adamw);
      auto scaler = scaler_for_test();
      if (load) CHECK(pipe->load(dir.string(), opt, scaler) == from - 1);
      std::vector<double> scales;
      for (int step = from; step < to; ++step) {
        auto [x, t] = batch(step);
        pipe->train_step(x, t, loss_at(step, kBad), scaler, sched::one_f_one_b{});
        scaler.step(opt);
        scaler.update();
        for (auto& p : pipe->parameters()) p.mutable_grad().reset();
        scales.push_back(scaler.get_scale());
        if (save_at && step == *save_at) pipe->save(dir.string(), opt, scaler, step);
      }
      return std::make_pair(seq, scales);
    };
    const auto [whole, whole_scales] = run(0, kSteps, std::nullopt, false);
    run(0, 5, 3, false);  // saved after step 3 (a grown scale, mid-interval), then lost
    const auto [resumed, resumed_scales] = run(4, kSteps, std::nullopt, true);
    CHECK(std::vector<double>(whole_scales.begin() + 4, whole_scales.end()) == resumed_scales);
    const auto pa = whole->parameters(), pb = resumed->parameters();
    for (std::size_t k = 0; k < pa.size(); ++k) CHECK(torch::equal(pa[k], pb[k]));

    auto seq = mlp();
    auto pipe = sw::Pipe(seq, sw::balance{3, 5}, sw::PipeOptions().chunks(4));
    torch::optim::AdamW opt(pipe->parameters(), adamw);
    pipe->save((dir / "plain").string(), opt, 1);
    auto scaler = scaler_for_test();
    const auto before = seq->parameters().front().detach().clone();
    CHECK(error_of([&] { pipe->load((dir / "plain").string(), opt, scaler); }) ==
          "stagewise::Pipe::load: the save in " + (dir / "plain").string() +
              " has no GradScaler state (it was saved without one); load it with load(dir, "
              "optimizer), or resume from a save made with save(dir, optimizer, scaler, step)");
    CHECK(torch::equal(before, seq->parameters().front()));
  }

  TEST_CASE("the scaled fused step inside a clip that has no scaler is refused, naming the fix") {
    auto seq = mlp();
    auto pipe = sw::Pipe(seq, sw::balance{3, 5}, sw::PipeOptions().chunks(2));
    sw::optim::FusedStep fused(pipe->parameters(), adamw);
    auto scaler = scaler_for_test();
    auto [x, t] = batch(0);
    const auto before = seq->parameters().front().detach().clone();
    CHECK(error_of([&] {
            pipe->clip_grad_norm_step(fused, [&] { pipe->train_step(x, t, mse, fused, scaler); },
                                      1.0);
          }) ==
          "stagewise::Pipe::train_step: the fused step under a GradScaler runs inside the passes "
          "of a clip (or scaler.step) given no GradScaler, which would measure scaled gradients; "
          "pass this scaler to it too (pipe->clip_grad_norm_step(fused, closure, max_norm, "
          "scaler))");
    CHECK(torch::equal(before, seq->parameters().front()));
    // And the other way round: a clip with the scaler around a train_step without it (a scaler
    // that has a scale from earlier steps).
    scaler.scale(torch::ones({}));
    CHECK(error_of([&] {
            pipe->clip_grad_norm_step(fused, [&] { pipe->train_step(x, t, mse, fused); }, 1.0,
                                      scaler);
          }).find("the closure back-propagated a loss the GradScaler did not scale") !=
          std::string::npos);
    CHECK(torch::equal(before, seq->parameters().front()));
  }
}
