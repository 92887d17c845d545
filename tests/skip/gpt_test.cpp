// examples/gpt's model in a pipe: its first step's gradients, clipped norm and update equal the
// unpipelined model's, with the RoPE tables, the causal mask and the int64 token ids carried from
// stage 0 to the block stages as skips.
#include "examples/gpt/model.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sw = stagewise;

namespace {

gpt::Config small() {
  gpt::Config c;
  c.dim = 16;
  c.heads = 2;
  c.layers = 3;
  c.context = 12;
  return c;
}

torch::nn::Sequential model_with_seed() {
  torch::manual_seed(7);
  return gpt::make_model(small());
}

// Token ids with document starts (byte 0) inside the rows, so the document mask, built in each
// block from the ids it pops, matters; and next-byte targets.
std::pair<torch::Tensor, torch::Tensor> batch() {
  torch::manual_seed(11);
  auto ids = torch::randint(1, 256, {6, 13}, torch::kLong);
  ids.index_put_({torch::indexing::Slice(), 0}, 0);
  ids.index_put_({torch::indexing::Slice(0, 3), 5}, 0);
  return {ids.narrow(1, 0, 12).contiguous(), ids.narrow(1, 1, 12).contiguous()};
}

// The unpipelined gradients over the same micro-batches (each loss weighted by its rows' share).
std::vector<torch::Tensor> reference_grads(torch::nn::Sequential& m, int64_t chunks) {
  auto [x, y] = batch();
  auto xs = x.chunk(chunks);
  auto ys = y.chunk(chunks);
  for (std::size_t i = 0; i < xs.size(); ++i) {
    auto loss = gpt::lm_loss(m->forward(xs[i]), ys[i]) * (double(xs[i].size(0)) / double(x.size(0)));
    loss.backward();
  }
  std::vector<torch::Tensor> g;
  for (auto& p : m->parameters()) g.push_back(p.grad().clone());
  return g;
}

double max_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].defined());
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  }
  return worst;
}

template <class Schedule>
void check_gradients(const sw::balance& b, sw::Checkpoint mode, Schedule sched) {
  auto ref = model_with_seed();
  const auto expected = reference_grads(ref, 3);
  auto model = model_with_seed();
  auto pipe = sw::Pipe(model, b, sw::PipeOptions().chunks(3).checkpoint(mode));
  auto [x, y] = batch();
  pipe->train_step(x, y, gpt::lm_loss, sched);
  std::vector<torch::Tensor> got;
  for (auto& p : pipe->parameters()) got.push_back(p.grad());
  CHECK(max_diff(got, expected) <= 1e-6);
}

}  // namespace

TEST_SUITE("gpt example") {
  TEST_CASE("the pipelined model's gradients equal the unpipelined model's: skips and int64 ids") {
    // Blocks in the stage after the embedding ({1, 3, 1}), and split between stages ({2, 3}).
    check_gradients(sw::balance{1, 3, 1}, sw::Checkpoint::except_last, sw::schedule::one_f_one_b{});
    check_gradients(sw::balance{2, 3}, sw::Checkpoint::always, sw::schedule::zero_bubble_h1{});
  }

  TEST_CASE("a document that starts mid-row is computed as if it opened the row") {
    // The blocks mask attention at the document starts they find in the popped ids, and RoPE
    // depends only on relative positions: rows 0-2 start a document at position 5.
    auto m = model_with_seed();
    auto [x, y] = batch();
    torch::NoGradGuard no_grad;
    auto rows = x.narrow(0, 0, 3);
    auto whole = m->forward(rows).narrow(1, 5, 7);
    auto tail = m->forward(rows.narrow(1, 5, 7).contiguous());
    CHECK(torch::allclose(whole, tail, 1e-4, 1e-5));
    auto unmasked = m->forward(rows.clamp_min(1)).narrow(1, 5, 7);  // no document starts
    CHECK_FALSE(torch::allclose(unmasked.narrow(1, 1, 6), tail.narrow(1, 1, 6), 1e-3, 1e-3));
  }

  TEST_CASE("the fused, clipped AdamW step equals clip_grad_norm_ and AdamW on the unpipelined model") {
    auto ref = model_with_seed();
    reference_grads(ref, 2);
    const double expected_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
    torch::optim::AdamW plain(ref->parameters(), adamw);
    plain.step();

    auto model = model_with_seed();
    auto pipe = sw::Pipe(model, sw::balance{1, 3, 1}, sw::PipeOptions().chunks(2));
    sw::optim::FusedStep fused(pipe->named_parameters(), adamw);
    auto [x, y] = batch();
    const auto r = sw::optim::clip_grad_norm_step(
        fused, [&] { pipe->train_step(x, y, gpt::lm_loss, fused, sw::schedule::one_f_one_b{}); },
        0.5);
    CHECK(r.total_norm > 0.5);  // the clip acts
    CHECK(r.total_norm == doctest::Approx(expected_norm).epsilon(1e-6));
    std::vector<torch::Tensor> a, b;
    for (auto& p : model->parameters()) a.push_back(p.detach());
    for (auto& p : ref->parameters()) b.push_back(p.detach());
    CHECK(max_diff(a, b) <= 1e-6);
    for (auto& p : pipe->parameters()) CHECK_FALSE(p.grad().defined());
  }

  TEST_CASE("a bad configuration is refused, naming the flag") {
    auto c = small();
    c.heads = 3;
    CHECK_THROWS_WITH(gpt::make_model(c), doctest::Contains("--heads"));
    c = small();
    c.layers = gpt::Config::max_layers + 1;
    CHECK_THROWS_WITH(gpt::make_model(c), doctest::Contains("--layers must be 1 to 12"));
    auto m = model_with_seed();
    CHECK_THROWS_WITH(m->forward(torch::zeros({1, 13}, torch::kLong)),
                      doctest::Contains("longer than the context"));
  }
}
