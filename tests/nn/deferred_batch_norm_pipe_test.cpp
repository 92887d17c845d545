#include "stagewise/pipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = sw::schedule;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.allclose(b, /*rtol=*/1e-5, /*atol=*/1e-6);
}

// Eight layers; batch norms at 1 (momentum 0.1) and 4 (cumulative average).
torch::nn::Sequential make_model() {
  torch::manual_seed(11);
  torch::nn::Sequential model(
      torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU(),
      torch::nn::Linear(8, 8),
      torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(8).momentum(c10::nullopt)),
      torch::nn::Tanh(), torch::nn::Linear(8, 3), torch::nn::Sigmoid());
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    if (contains(p.key(), "1.") || contains(p.key(), "4.")) p.value().uniform_(0.5, 1.5);
  }
  return model;
}

torch::nn::Sequential copy_of(const torch::nn::Sequential& model) {
  return torch::nn::Sequential(
      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
}

const std::vector<std::size_t> bn_layers{1, 4};

// Plain batch norm run chunk by chunk: the output, and each batch norm's inputs of all chunks.
struct ByChunks {
  torch::Tensor out;
  std::map<std::size_t, torch::Tensor> bn_inputs;
};
ByChunks run_by_chunks(torch::nn::Sequential model, const torch::Tensor& x, int64_t chunks) {
  ByChunks r;
  std::vector<torch::Tensor> outs;
  std::map<std::size_t, std::vector<torch::Tensor>> inputs;
  for (const auto& micro : sw::scatter(sw::Batch(x), chunks)) {
    torch::Tensor h = micro.tensor();
    for (std::size_t l = 0; l < model->size(); ++l) {
      if (l == 1 || l == 4) inputs[l].push_back(h.detach());
      h = (model->begin() + static_cast<std::ptrdiff_t>(l))->forward(h);
    }
    outs.push_back(h);
  }
  r.out = torch::cat(outs);
  for (auto& [l, list] : inputs) r.bn_inputs[l] = torch::cat(list);
  return r;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

// Two training steps of `run` (pipelined) against plain batch norm: running statistics equal
// plain batch norm over each whole batch, outputs and gradients equal it chunk by chunk.
template <class Run>
void check_against_plain(int64_t chunks, sw::Checkpoint mode, int64_t rows, Run run) {
  auto model = make_model();
  auto reference = copy_of(model);
  // The statistics plain batch norm would keep over whole batches.
  std::map<std::size_t, std::shared_ptr<torch::nn::BatchNorm1dImpl>> whole;
  for (auto l : bn_layers) {
    whole[l] = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(model[l]->clone());
  }
  auto pipe = sw::Pipe(model, sw::balance{2, 2, 2, 2},
                       sw::PipeOptions().chunks(chunks).checkpoint(mode).deferred_batch_norm(true));
  for (auto l : bn_layers)
    REQUIRE(std::dynamic_pointer_cast<sw::DeferredBatchNormImpl>(pipe->layer(l)));
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    model->zero_grad();
    reference->zero_grad();
    auto x = torch::randn({rows, 4}) * 2 + 1;
    auto t = torch::rand({rows, 3});
    auto expected = run_by_chunks(reference, x, chunks);
    mse(expected.out, t).backward();
    for (auto l : bn_layers) whole[l]->forward(expected.bn_inputs[l]);
    auto out = run(pipe, x, t);
    if (out.defined()) CHECK(close(out, expected.out));
    const auto got_grads = model->parameters();
    const auto want_grads = reference->parameters();
    REQUIRE(got_grads.size() == want_grads.size());
    for (std::size_t k = 0; k < got_grads.size(); ++k) {
      CAPTURE(k);
      REQUIRE(got_grads[k].grad().defined());
      CHECK(close(got_grads[k].grad(), want_grads[k].grad()));
    }
    for (auto l : bn_layers) {
      CAPTURE(l);
      auto got = model[l]->named_buffers();
      CHECK(close(got["running_mean"], whole[l]->running_mean));
      CHECK(close(got["running_var"], whole[l]->running_var));
      CHECK(got["num_batches_tracked"].item<int64_t>() == step + 1);
      CHECK(std::dynamic_pointer_cast<sw::DeferredBatchNormImpl>(pipe->layer(l))
                ->pending_micro_batches() == 0);
    }
  }
}

template <class Schedule>
void check_train_step(const Schedule& sched_, sw::Checkpoint mode) {
  check_against_plain(4, mode, 11,
                      [&](sw::Pipe<>& pipe, const torch::Tensor& x, const torch::Tensor& t) {
                        pipe->train_step(x, t, mse, sched_);
                        return torch::Tensor();
                      });
}

const sw::Checkpoint modes[] = {sw::Checkpoint::never, sw::Checkpoint::except_last,
                                sw::Checkpoint::always};

}  // namespace

TEST_SUITE("deferred batch norm in a pipe") {
  TEST_CASE("forward: running statistics equal plain batch norm over the whole batch") {
    for (auto mode : modes) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(mode_name);
      // 11 rows in 4 chunks: 3, 3, 3, 2.
      check_against_plain(4, mode, 11,
                          [](sw::Pipe<>& pipe, const torch::Tensor& x, const torch::Tensor& t) {
                            auto out = pipe->forward(x);
                            mse(out, t).backward();
                            return out.detach();
                          });
    }
  }

  TEST_CASE("train_step with gpipe, 1F1B, interleaved 1F1B and ZB-H1") {
    for (auto mode : modes) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(mode_name);
      check_train_step(sched::gpipe{}, mode);
      check_train_step(sched::one_f_one_b{}, mode);
      check_train_step(sched::interleaved_one_f_one_b{2}, mode);
      check_train_step(sched::zero_bubble_h1{}, mode);
    }
  }

  TEST_CASE("a batch smaller than chunks commits after its own micro-batches") {
    // 3 rows and chunks(4): 3 micro-batches of one row; BatchNorm2d has 4 values per channel each.
    torch::manual_seed(5);
    torch::nn::BatchNorm2d bn(2);
    torch::nn::Sequential model(bn, torch::nn::ReLU());
    auto plain =
        torch::nn::BatchNorm2d(std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(bn->clone()));
    auto pipe =
        sw::Pipe(model, sw::balance{1, 1}, sw::PipeOptions().chunks(4).deferred_batch_norm(true));
    auto deferred = std::dynamic_pointer_cast<sw::DeferredBatchNormImpl>(pipe->layer(0));
    REQUIRE(deferred);
    for (const int64_t rows : {3, 8, 2}) {
      CAPTURE(rows);
      auto x = torch::randn({rows, 2, 2, 2}) + 3;
      pipe->train_step(x, torch::zeros({rows, 2, 2, 2}), mse);
      plain->forward(x);
      CHECK(deferred->pending_micro_batches() == 0);
      CHECK(close(bn->running_mean, plain->running_mean));
      CHECK(close(bn->running_var, plain->running_var));
      pipe->forward(x + 1);
      plain->forward(x + 1);
      CHECK(close(bn->running_mean, plain->running_mean));
      CHECK(close(bn->running_var, plain->running_var));
    }
    CHECK(bn->num_batches_tracked.item<int64_t>() == 6);
  }

  TEST_CASE("eval: the pipe normalises with the running statistics and leaves them alone") {
    auto model = make_model();
    auto reference = copy_of(model);
    auto pipe =
        sw::Pipe(model, sw::balance{4, 4}, sw::PipeOptions().chunks(2).deferred_batch_norm(true));
    pipe->eval();
    reference->eval();
    auto x = torch::randn({6, 4});
    CHECK(close(pipe->forward(x), reference->forward(x)));
    CHECK(model[1]->named_buffers()["num_batches_tracked"].item<int64_t>() == 0);
    CHECK(model[1]->named_buffers()["running_mean"].equal(torch::zeros({8})));
  }

  TEST_CASE("without the option the batch norms stay plain") {
    auto model = make_model();
    auto pipe = sw::Pipe(model, sw::balance{4, 4}, sw::PipeOptions().chunks(2));
    CHECK(std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(pipe->layer(1)));
    CHECK(pipe->parameters().size() == model->parameters().size());
  }

  TEST_CASE("a plain batch norm the option cannot reach is an error") {
    torch::nn::BatchNorm1d bn(4);
    const auto message = error_of([&] {
      sw::Pipe(sw::stages(torch::nn::Linear(4, 4), bn),
               sw::PipeOptions().chunks(2).deferred_batch_norm(true));
    });
    CHECK(contains(message, "deferred batch norm cannot reach the batch norm 'stage1'"));
    CHECK(contains(message, "Build that module with stagewise::DeferredBatchNorm in its place"));
  }
}
