// Skip connections under every schedule, split backward (I then W) included: a U-Net and a skip
// over an embedding (integer ids, no gradient) trained by train_step equal the unpipelined model
// on the same micro-batches bit for bit, in every checkpoint mode.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/v_min.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"
#include "stagewise/skip/skippable.hpp"

#include <torch/torch.h>

#include "tests/support/kernels.hpp"
#include "tests/support/schedule_fixture.hpp"
#include "tests/support/unet.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;

namespace {

struct Level1 {};
struct Level2 {};
using sw::testing::Down;
using sw::testing::Up;

torch::nn::Sequential unet() {
  return torch::nn::Sequential(Down<Level1>(2, 4), Down<Level2>(4, 8),
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)),
                               Up<Level2>(8, 8, 4), Up<Level1>(4, 4, 4),
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 2, 1)));
}

// Stashes the token ids (integers: no gradient) before embedding them; a later stage pops them
// as a mask.
using skip_ids = sw::skip<Level1, "ids">;
struct EmbedImpl : sw::Skippable<EmbedImpl, sw::stashes<skip_ids>> {
  EmbedImpl() : embed(register_module("embed", torch::nn::Embedding(10, 4))) {}
  torch::Tensor forward(torch::Tensor ids) {
    stash<skip_ids>(ids);
    return embed(ids);
  }
  torch::nn::Embedding embed;
};
TORCH_MODULE(Embed);
struct MaskImpl : sw::Skippable<MaskImpl, sw::pops<skip_ids>> {
  MaskImpl() : linear(register_module("linear", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(torch::Tensor h) {
    auto ids = pop<skip_ids>();
    return linear(h) * (ids > 2).unsqueeze(-1).to(h.dtype());
  }
  torch::nn::Linear linear;
};
TORCH_MODULE(Mask);

torch::nn::Sequential embedding_model() {
  return torch::nn::Sequential(Embed(), torch::nn::Linear(4, 4), torch::nn::Tanh(), Mask());
}

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

// The unpipelined model on the same micro-batches, backwards in the order every stage of the
// schedule runs them (descending for GPipe and looped BFS, ascending for the others), so each
// gradient sums the same terms in the same order.
std::pair<torch::Tensor, std::vector<torch::Tensor>> reference(torch::nn::Sequential& seq,
                                                               const torch::Tensor& x,
                                                               const torch::Tensor& t, int chunks,
                                                               bool ascending) {
  seq->zero_grad();
  const auto total = sw::testing::reference_step(*seq, x, t, chunks, ascending, mse);
  std::vector<torch::Tensor> grads;
  for (auto& p : seq->parameters()) grads.push_back(p.grad().clone());
  seq->zero_grad();
  return {total, grads};
}

struct Case {
  std::string name;
  sw::balance balance;
  bool ascending = true;
  std::function<torch::Tensor(sw::Pipe<>&, const torch::Tensor&, const torch::Tensor&)> step;
};

template <class Schedule>
Case make(std::string name, sw::balance b, bool ascending, Schedule s) {
  return {std::move(name), std::move(b), ascending,
          [s](sw::Pipe<>& pipe, const torch::Tensor& x, const torch::Tensor& t) {
            return pipe->train_step(x, t, mse, s);
          }};
}

// Every schedule on `model`, whose six (U-Net) or four (embedding) layers are cut into `three`
// (3 stages) or `four` (4 stages, 2 per worker for the interleaved, looped and V schedules).
std::vector<Case> cases(sw::balance three, sw::balance four) {
  return {make("gpipe", three, false, sched::gpipe{}),
          make("one_f_one_b", three, true, sched::one_f_one_b{}),
          make("zero_bubble_h1", three, true, sched::zero_bubble_h1{}),
          make("interleaved_one_f_one_b", four, true, sched::interleaved_one_f_one_b{2}),
          make("looped_bfs", four, false, sched::looped_bfs{2}),
          make("zero_bubble_v", four, true, sched::zero_bubble_v{}),
          make("v_half", four, true, sched::v_half{}),
          make("v_min", four, true, sched::v_min{}),
          make("dualpipe_v", four, true, sched::dualpipe_v{})};
}

void check_all(const std::function<torch::nn::Sequential()>& model, const torch::Tensor& x,
               const torch::Tensor& t, const std::vector<Case>& all) {
  stagewise::testing::use_plain_convolutions();
  for (const auto& c : all) {
    for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(c.name);
      CAPTURE(mode_name);
      torch::manual_seed(11);
      auto seq = model();
      const auto [loss, grads] = reference(seq, x, t, 4, c.ascending);
      auto pipe = sw::Pipe(seq, c.balance, sw::PipeOptions().chunks(4).checkpoint(mode));
      const auto got = c.step(pipe, x, t);
      CHECK(got.item<float>() == loss.item<float>());
      const auto params = seq->parameters();
      REQUIRE(params.size() == grads.size());
      for (std::size_t k = 0; k < params.size(); ++k) {
        CAPTURE(k);
        REQUIRE(params[k].grad().defined());
        CHECK(params[k].grad().equal(grads[k]));
      }
    }
  }
}

}  // namespace

TEST_SUITE("skips in every schedule") {
  TEST_CASE("a U-Net trains bit for bit like the unpipelined model under every schedule") {
    torch::manual_seed(0);
    const auto x = torch::randn({8, 2, 8, 8});
    const auto t = torch::randn({8, 2, 8, 8});
    check_all(unet, x, t, cases(sw::balance{2, 2, 2}, sw::balance{1, 2, 2, 1}));
  }

  TEST_CASE("a skip over an embedding (integer ids, no gradient) works under every schedule") {
    torch::manual_seed(0);
    const auto ids = torch::randint(0, 10, {8, 3});
    const auto t = torch::randn({8, 3, 4});
    check_all(embedding_model, ids, t, cases(sw::balance{1, 2, 1}, sw::balance{1, 1, 1, 1}));
  }
}
