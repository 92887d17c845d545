// The one pipe over a transport of the test's own (pipe/detail/pipe_over.hpp): what adding a
// transport takes (one class satisfying runtime::pipe_transport, and this test). Two "ranks" run
// in one process, each a PipeOver keeping one stage of the same model, joined by a wire that
// hands messages to the other rank's mailbox: the step must equal the one-process Pipe bit for
// bit, with exactly the messages the plan sends across, the step values shared from the right
// rank, and a failure on one rank reaching both.

#include "stagewise/pipe/detail/pipe_over.hpp"
#include "stagewise/pipe.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"
#include "stagewise/runtime/transport.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/stage/partition.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sw = stagewise;
using sw::runtime::Message;
using sw::runtime::MessageKey;

namespace {

// What joins the two ranks: a mailbox each (stage j's messages go to rank j's), a barrier at the
// start of each step (so no message reaches a mailbox before its rank began the step), and the
// shared step values.
struct Wire {
  std::array<sw::runtime::MailboxTransport, 2> inbox;
  std::mutex mutex;
  std::condition_variable changed;
  std::array<std::int64_t, 2> begun{0, 0};
  std::array<std::int64_t, 2> ended{0, 0};
  std::map<std::pair<std::int64_t, int>, torch::Tensor> values;  // (step, index) -> value
  int failed = -1;                                               // the first rank that aborted
  std::string what;
};

// One rank's end of the wire: the transport class a new transport would be.
class WireEnd {
 public:
  WireEnd(std::shared_ptr<Wire> wire, int rank) : wire_(std::move(wire)), rank_(rank) {}

  void send(const MessageKey& k, Message m) {
    if (k.stage != rank_) ++traffic_.messages_sent;
    wire_->inbox[static_cast<std::size_t>(k.stage)].send(k, std::move(m));
  }
  // As a transport between processes must: nothing once this rank aborted, an error naming the
  // rank once another one did.
  std::optional<Message> recv(const MessageKey& k) {
    auto m = wire_->inbox[static_cast<std::size_t>(rank_)].recv(k);
    if (!m) throw_if_other_failed();
    if (m && k.stage != source(k)) ++traffic_.messages_received;
    return m;
  }
  // The mailboxes first, then the word: a rank that sees `failed` set finds its mailbox's first
  // error already there (the one the pipe rethrows), as C10dTransport::abort orders it.
  void abort(std::exception_ptr e) {
    for (auto& box : wire_->inbox) box.abort(e);
    std::lock_guard<std::mutex> lock(wire_->mutex);
    if (wire_->failed < 0) {
      wire_->failed = rank_;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        wire_->what = x.what();
      } catch (...) {
      }
    }
    wire_->changed.notify_all();
  }
  void begin_step(const sw::schedule::Plan& plan,
                  const std::vector<sw::schedule::SkipRoute>& routes) {
    ++begun_;
    wire_->inbox[static_cast<std::size_t>(rank_)].begin_step(plan, routes);
    std::unique_lock<std::mutex> lock(wire_->mutex);
    wire_->begun[static_cast<std::size_t>(rank_)] = step_;
    wire_->changed.notify_all();
    wire_->changed.wait(lock, [&] { return wire_->begun[0] >= step_ && wire_->begun[1] >= step_; });
  }
  torch::Tensor share(const torch::Tensor& value, int from, int index) {
    shares_.push_back({from, index});
    if (index == 0) ++step_;  // the count opens every step
    std::unique_lock<std::mutex> lock(wire_->mutex);
    const auto key = std::make_pair(step_, index);
    if (from == rank_) {
      wire_->values[key] = value.detach();
      wire_->changed.notify_all();
      return value;
    }
    wire_->changed.wait(lock, [&] { return wire_->failed >= 0 || wire_->values.count(key) > 0; });
    if (wire_->values.count(key) > 0) return wire_->values[key];
    lock.unlock();
    throw_if_other_failed();
    return {};
  }
  // Returns once both ranks finished the step; throws when the other one failed instead.
  void end_step() {
    {
      std::unique_lock<std::mutex> lock(wire_->mutex);
      wire_->ended[static_cast<std::size_t>(rank_)] = step_;
      wire_->changed.notify_all();
      wire_->changed.wait(lock, [&] {
        return wire_->failed >= 0 || (wire_->ended[0] >= step_ && wire_->ended[1] >= step_);
      });
      if (wire_->failed < 0) return;
    }
    throw_if_other_failed();
  }
  std::exception_ptr error() const { return wire_->inbox[static_cast<std::size_t>(rank_)].error(); }
  sw::runtime::Traffic traffic() const { return traffic_; }

  int begun() const { return begun_; }
  const std::vector<std::pair<int, int>>& shares() const { return shares_; }

 private:
  void throw_if_other_failed() {
    std::lock_guard<std::mutex> lock(wire_->mutex);
    if (wire_->failed >= 0 && wire_->failed != rank_) {
      throw std::runtime_error("rank " + std::to_string(wire_->failed) + " failed: " + wire_->what);
    }
  }
  static int source(const MessageKey& k) {
    return k.kind == sw::schedule::TransferKind::activation ? k.stage - 1 : k.stage + 1;
  }

  std::shared_ptr<Wire> wire_;
  int rank_;
  std::int64_t step_ = 0;
  int begun_ = 0;
  std::vector<std::pair<int, int>> shares_;
  sw::runtime::Traffic traffic_;
};

static_assert(sw::runtime::pipe_transport<WireEnd>);

// Rank `rank`'s pipe: stage `rank` of `seq` split into two stages, over the wire.
class WirePipe : public sw::detail::PipeOver<WireEnd> {
 public:
  WirePipe(const torch::nn::Sequential& seq, const sw::balance& b, sw::PipeOptions options,
           std::shared_ptr<Wire> wire, int rank)
      : PipeOver("wire pipe", std::move(options)) {
    build_stages(sw::detail::partition(seq, b),
                 [rank](std::size_t j) { return static_cast<int>(j) == rank; });
    set_transport(std::make_unique<WireEnd>(std::move(wire), rank));
  }
  const WireEnd& wire_end() const { return *transport_; }
};

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               torch::nn::ReLU(), torch::nn::Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

// Runs one step on both ranks at once (rank 0 gives the input, rank 1 the target); returns each
// rank's loss, or its error's text.
template <class Step0, class Step1>
std::array<std::string, 2> both(Step0 step0, Step1 step1, std::array<torch::Tensor, 2>& losses) {
  std::array<std::string, 2> errors{"", ""};
  auto run = [&](int r, auto step) {
    try {
      losses[static_cast<std::size_t>(r)] = step();
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  };
  std::thread t0([&] { run(0, step0); });
  std::thread t1([&] { run(1, step1); });
  t0.join();
  t1.join();
  return errors;
}

}  // namespace

TEST_SUITE("one pipe over any transport") {
  TEST_CASE("two ranks over a test wire equal the one-process pipe bit for bit") {
    torch::manual_seed(3);
    auto seq = mlp();
    auto ref_seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
    const auto x = torch::randn({8, 6});
    const auto y = torch::randn({8, 3});
    const auto options = sw::PipeOptions().chunks(4).checkpoint(sw::Checkpoint::always);
    auto ref = sw::Pipe(torch::nn::Sequential(ref_seq), sw::balance{3, 2}, options);
    auto wire = std::make_shared<Wire>();
    auto rank0 = std::make_shared<WirePipe>(seq, sw::balance{3, 2}, options, wire, 0);
    auto rank1 = std::make_shared<WirePipe>(seq, sw::balance{3, 2}, options, wire, 1);
    CHECK(rank0->parameters().size() == 4);  // stage 0's two Linears
    CHECK(rank1->parameters().size() == 2);

    for (int step = 0; step < 2; ++step) {
      const auto want = ref->train_step(x, y, mse, sw::schedule::one_f_one_b{});
      std::array<torch::Tensor, 2> losses;
      const auto errors = both(
          [&] { return rank0->train_step(x, torch::Tensor(), mse, sw::schedule::one_f_one_b{}); },
          [&] { return rank1->train_step(torch::Tensor(), y, mse, sw::schedule::one_f_one_b{}); },
          losses);
      REQUIRE(errors[0] == "");
      REQUIRE(errors[1] == "");
      CHECK(torch::equal(losses[0], want));  // rank 0 gets rank 1's loss through share
      CHECK(torch::equal(losses[1], want));
    }
    const auto params = seq->parameters();
    const auto ref_params = ref_seq->parameters();
    REQUIRE(params.size() == ref_params.size());
    for (std::size_t k = 0; k < params.size(); ++k) {
      CAPTURE(k);
      CHECK(torch::equal(params[k].grad(), ref_params[k].grad()));
    }
    // Each step: 4 activations cross 0 -> 1 and 4 gradients 1 -> 0; nothing else.
    CHECK(rank0->traffic().messages_sent == 8);
    CHECK(rank0->traffic().messages_received == 8);
    CHECK(rank1->traffic().messages_sent == 8);
    CHECK(rank1->traffic().messages_received == 8);
    // One begin_step per step; the count shared from stage 0's rank, the loss from stage 1's.
    const std::vector<std::pair<int, int>> shares{{0, 0}, {1, 1}, {0, 0}, {1, 1}};
    for (const auto* pipe : {rank0.get(), rank1.get()}) {
      CHECK(pipe->wire_end().begun() == 2);
      CHECK(pipe->wire_end().shares() == shares);
    }
  }

  TEST_CASE("a failure on one rank stops both, each with the failing cell named") {
    auto seq = mlp();
    auto wire = std::make_shared<Wire>();
    const auto options = sw::PipeOptions().chunks(2);
    auto rank0 = std::make_shared<WirePipe>(seq, sw::balance{3, 2}, options, wire, 0);
    auto rank1 = std::make_shared<WirePipe>(seq, sw::balance{3, 2}, options, wire, 1);
    auto bad_loss = [](const torch::Tensor& out, const torch::Tensor&) -> torch::Tensor {
      (void)out;
      throw std::runtime_error("the loss refuses");
    };
    std::array<torch::Tensor, 2> losses;
    const auto errors = both(
        [&] {
          return rank0->train_step(torch::randn({4, 6}), torch::Tensor(), bad_loss);
        },
        [&] {
          return rank1->train_step(torch::Tensor(), torch::randn({4, 3}), bad_loss);
        },
        losses);
    // Rank 1's loss fails in micro-batch 0's forward; rank 0, waiting for a gradient, fails with
    // it: the pipe rethrows the step's first error (the one the wire gave rank 0's mailbox).
    CHECK(errors[1] == errors[0]);
    CHECK(sw::testing::contains(errors[1], "the loss refuses"));
  }
}
