#include "stagewise/pipe.hpp"
#include "stagewise/runtime/detail/portal_tracker.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/stage/seq.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/kernels.hpp"
#include "tests/support/unet.hpp"

#include <doctest/doctest.h>

#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace pt {

struct E1 {};
struct E2 {};
template <class Ns>
using sx = sw::skip<Ns, "x">;

const sw::Checkpoint modes[] = {sw::Checkpoint::always, sw::Checkpoint::except_last,
                                sw::Checkpoint::never};

// Facts seen on worker threads, checked afterwards on the test thread.
struct Log {
  std::mutex mutex;
  std::vector<std::string> problems;
  int stash_checks = 0;     // made by CheckedStash
  int backward_checks = 0;  // made by NoPortalTensorAtBackward
  void fail(std::string what) {
    std::lock_guard<std::mutex> lock(mutex);
    problems.push_back(std::move(what));
  }
};
Log& log() {
  static Log l;
  return l;
}

int count_nodes(const std::shared_ptr<torch::autograd::Node>& root, const std::string& name) {
  std::vector<torch::autograd::Node*> stack{root.get()};
  std::set<torch::autograd::Node*> seen;
  int count = 0;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (contains(node->name(), name)) ++count;
    for (const auto& e : node->next_edges()) stack.push_back(e.function.get());
  }
  return count;
}

// ---- portal tensor life, as torchgpipe's test_delete_portal_tensor checks it ----

// The portal the stash of this cell will create; filled by CheckedStash in the same cell run.
thread_local std::shared_ptr<c10::intrusive_ptr<sw::runtime::detail::Portal>> pending_slot;

// Identity whose backward checks that the portal of its micro-batch has released its tensor:
// by the time backward reaches the first layer, the skip must be freed.
struct NoPortalTensorAtBackward : torch::autograd::Function<NoPortalTensorAtBackward> {
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx, torch::Tensor x,
      std::shared_ptr<c10::intrusive_ptr<sw::runtime::detail::Portal>>* slot) {
    ctx->saved_data["slot"] = reinterpret_cast<int64_t>(new auto(*slot));
    return x.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto* slot =
        reinterpret_cast<std::shared_ptr<c10::intrusive_ptr<sw::runtime::detail::Portal>>*>(
            ctx->saved_data["slot"].toInt());
    const auto& portal = **slot;
    {
      std::lock_guard<std::mutex> lock(log().mutex);
      ++log().backward_checks;
    }
    if (!portal) {
      log().fail("no portal recorded for this micro-batch");
    } else if (portal->tensor_life() != 0 || portal->has_tensor()) {
      log().fail("portal still holds its tensor at the first layer's backward (life " +
                 std::to_string(portal->tensor_life()) + ")");
    }
    delete slot;
    return {g[0], torch::Tensor()};
  }
};
struct FirstImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) {
    pending_slot = std::make_shared<c10::intrusive_ptr<sw::runtime::detail::Portal>>();
    if (!torch::GradMode::is_enabled()) return x;
    return NoPortalTensorAtBackward::apply(x, &pending_slot);
  }
};
TORCH_MODULE(First);

int expected_life_after(bool stash) {
  if (sw::is_checkpointing()) return stash ? 2 : 1;
  if (sw::is_recomputing()) return 0;
  return stash ? 1 : 0;
}

struct CheckedStashImpl : sw::Skippable<CheckedStashImpl, sw::stashes<sx<E1>>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<sx<E1>>(x);
    auto* cell = sw::runtime::detail::PortalCell::current();
    if (cell == nullptr) {
      log().fail("no portal cell installed in a pipe");
      return x;
    }
    auto portal = cell->tracker().portal_ptr(sw::skip_info_of<sx<E1>>);
    if (!portal) {
      log().fail("stash of a crossing skip made no portal");
    } else if (portal->tensor_life() != expected_life_after(true)) {
      log().fail("life after stash " + std::to_string(portal->tensor_life()) + ", expected " +
                 std::to_string(expected_life_after(true)));
    }
    if (pending_slot) *pending_slot = portal;
    std::lock_guard<std::mutex> lock(log().mutex);
    ++log().stash_checks;
    return x;
  }
};
TORCH_MODULE(CheckedStash);

struct CheckedPopImpl : sw::Skippable<CheckedPopImpl, sw::pops<sx<E1>>> {
  torch::Tensor forward(torch::Tensor x) {
    auto skip = pop<sx<E1>>();
    auto* portal =
        sw::runtime::detail::PortalCell::current()->tracker().portal(sw::skip_info_of<sx<E1>>);
    if (portal->tensor_life() != expected_life_after(false)) {
      log().fail("life after pop " + std::to_string(portal->tensor_life()) + ", expected " +
                 std::to_string(expected_life_after(false)));
    }
    return x + skip;
  }
};
TORCH_MODULE(CheckedPop);

// ---- small layers ----
template <class Ns>
struct StashImpl : sw::Skippable<StashImpl<Ns>, sw::stashes<sx<Ns>>> {
  torch::Tensor forward(torch::Tensor x) {
    sw::stash<sx<Ns>>(this, x);
    return x;
  }
};
template <class Ns>
using Stash = torch::nn::ModuleHolder<StashImpl<Ns>>;

template <class Ns>
struct PopImpl : sw::Skippable<PopImpl<Ns>, sw::pops<sx<Ns>>> {
  torch::Tensor forward(torch::Tensor x) { return x + sw::pop<sx<Ns>>(this); }
};
template <class Ns>
using Pop = torch::nn::ModuleHolder<PopImpl<Ns>>;

struct StashNoneImpl : sw::Skippable<StashNoneImpl, sw::stashes<sx<E2>>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<sx<E2>>(torch::Tensor());
    return x;
  }
};
TORCH_MODULE(StashNone);
struct PopNoneImpl : sw::Skippable<PopNoneImpl, sw::pops<sx<E2>>> {
  torch::Tensor forward(torch::Tensor x) {
    if (pop<sx<E2>>().defined()) log().fail("popped a defined tensor where None was stashed");
    return x;
  }
};
TORCH_MODULE(PopNone);

// Stashes the token ids (no gradient) before embedding them; the pop uses them as a mask.
using skip_ids = sw::skip<E1, "ids">;
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

// Stashes a tensor that requires grad; the pop uses it without gradient.
using skip_scale = sw::skip<E2, "scale">;
struct ScaleStashImpl : sw::Skippable<ScaleStashImpl, sw::stashes<skip_scale>> {
  ScaleStashImpl() : linear(register_module("linear", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = linear(x);
    stash<skip_scale>(h);
    return h;
  }
  torch::nn::Linear linear;
};
TORCH_MODULE(ScaleStash);
struct ScalePopImpl : sw::Skippable<ScalePopImpl, sw::pops<skip_scale>> {
  ScalePopImpl() : linear(register_module("linear", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(torch::Tensor h) {
    return linear(h) * pop<skip_scale>().detach().sigmoid();
  }
  torch::nn::Linear linear;
};
TORCH_MODULE(ScalePop);

// ---- a small U-Net whose encoder levels stash and decoder levels pop, one namespace per level
using sw::testing::Down;
using sw::testing::Up;

struct UNet {
  Down<E1> d1{2, 4};
  Down<E2> d2{4, 8};
  torch::nn::Conv2d mid{torch::nn::Conv2dOptions(8, 8, 3).padding(1)};
  Up<E2> u2{8, 8, 4};
  Up<E1> u1{4, 4, 4};
  torch::nn::Conv2d head{torch::nn::Conv2dOptions(4, 2, 1)};

  torch::Tensor forward(torch::Tensor x) { return head(u1(u2(mid(d2(d1(x)))))); }
  std::vector<torch::Tensor> parameters() {
    std::vector<torch::Tensor> out;
    for (auto* m : std::vector<torch::nn::Module*>{d1.get(), d2.get(), mid.get(), u2.get(),
                                                   u1.get(), head.get()}) {
      for (auto& p : m->parameters()) out.push_back(p);
    }
    return out;
  }
  void zero_grad() {
    for (auto& p : parameters()) p.mutable_grad().reset();
  }
};

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && torch::allclose(a, b, 1e-5, 1e-6);
}

}  // namespace pt

using namespace pt;

TEST_SUITE("portals in a pipe") {
  TEST_CASE("tensor life 1/0, 2/1 under checkpointing, 0/0 recomputing; freed at the first layer") {
    for (auto mode : modes) {
      for (bool train : {true, false}) {
        const std::string mode_name = sw::to_string(mode);
        CAPTURE(mode_name);
        CAPTURE(train);
        log().problems.clear();
        log().stash_checks = log().backward_checks = 0;
        auto pipe = sw::Pipe(torch::nn::Sequential(First(), CheckedStash(), CheckedPop()),
                             sw::balance{2, 1}, sw::PipeOptions().chunks(2).checkpoint(mode));
        auto x = torch::rand({10, 1}, torch::requires_grad());
        if (train) {
          pipe->train();
          pipe->forward(x).norm().backward();
          CHECK(x.grad().defined());
        } else {
          pipe->eval();
          torch::NoGradGuard no_grad;
          pipe->forward(x);
        }
        CHECK(log().problems == std::vector<std::string>{});
        // Every micro-batch's stash was checked (again in its recompute), and in training every
        // first layer's backward saw its portal released.
        const int recomputed = !train                                ? 0
                               : mode == sw::Checkpoint::always      ? 2
                               : mode == sw::Checkpoint::except_last ? 1
                                                                     : 0;
        CHECK(log().stash_checks == 2 + recomputed);
        CHECK(log().backward_checks == (train ? 2 : 0));
      }
    }
  }

  TEST_CASE("no portal node for a skip within one stage") {
    auto pipe = sw::Pipe(torch::nn::Sequential(Stash<E1>(), Pop<E1>(), torch::nn::Linear(1, 1)),
                         sw::balance{2, 1}, sw::PipeOptions().chunks(2).checkpoint("never"));
    auto x = torch::rand({4, 1}, torch::requires_grad());
    auto y = pipe->forward(x);
    CHECK(count_nodes(y.grad_fn(), "Portal") == 0);
    y.sum().backward();
    CHECK(x.grad().defined());
  }

  TEST_CASE("a crossing skip puts portal nodes in the graph, and gives the right values") {
    auto pipe = sw::Pipe(torch::nn::Sequential(Stash<E1>(), torch::nn::Linear(1, 1), Pop<E1>()),
                         sw::balance{1, 1, 1}, sw::PipeOptions().chunks(3).checkpoint("never"));
    auto x = torch::rand({6, 1}, torch::requires_grad());
    auto y = pipe->forward(x);
    CHECK(count_nodes(y.grad_fn(), "PortalBlue") == 3);
    CHECK(count_nodes(y.grad_fn(), "PortalOrange") == 3);
    auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(pipe->layer(1));
    auto expected = x + linear->forward(x);
    CHECK(close(y, expected));
    y.sum().backward();
    CHECK(close(x.grad(), torch::ones_like(x) * (1 + linear->weight.item<float>())));
  }

  TEST_CASE("a stashed None across 2 stages, chunks 5: no portal node, input grad mean 1") {
    log().problems.clear();
    auto pipe = sw::Pipe(torch::nn::Sequential(StashNone(), PopNone()), sw::balance{1, 1},
                         sw::PipeOptions().chunks(5));
    auto x = torch::rand({10}, torch::requires_grad());
    auto y = pipe->forward(x);
    CHECK(count_nodes(y.grad_fn(), "Portal") == 0);
    y.sum().backward();
    CHECK(x.grad().mean().item<double>() == 1.0);
    CHECK(log().problems.empty());
  }
}

TEST_SUITE("skips without gradient") {
  // Reference: the same layers unpipelined, on the whole batch.
  template <class F>
  void compare(F && build, const torch::Tensor& x, sw::Checkpoint mode) {
    auto [seq, balance] = build();
    std::vector<torch::Tensor> params = seq->parameters();
    auto out = seq->forward(x);
    out.pow(2).mean().backward();
    std::vector<torch::Tensor> expected;
    for (auto& p : params) expected.push_back(p.grad().clone());
    seq->zero_grad();

    auto pipe = sw::Pipe(seq, balance, sw::PipeOptions().chunks(2).checkpoint(mode));
    auto y = pipe->forward(x);
    CHECK(close(y, out));
    y.pow(2).mean().backward();
    for (std::size_t k = 0; k < params.size(); ++k) CHECK(close(params[k].grad(), expected[k]));
    seq->zero_grad();

    pipe->train_step(x, torch::zeros_like(out), mse);
    for (std::size_t k = 0; k < params.size(); ++k) CHECK(close(params[k].grad(), expected[k]));
  }

  TEST_CASE("a skip over an embedding (integer ids) does not break backward") {
    for (auto mode : modes) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(mode_name);
      torch::manual_seed(0);
      auto ids = torch::randint(0, 10, {6, 3});
      compare(
          [] {
            return std::pair(torch::nn::Sequential(Embed(), Mask()), sw::balance{1, 1});
          },
          ids, mode);
    }
  }

  TEST_CASE("a popped tensor used without gradient does not break backward") {
    for (auto mode : modes) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(mode_name);
      torch::manual_seed(0);
      auto x = torch::randn({6, 4});
      compare(
          [] {
            return std::pair(
                torch::nn::Sequential(ScaleStash(), torch::nn::Linear(4, 4), ScalePop()),
                sw::balance{1, 1, 1});
          },
          x, mode);
    }
  }
}

TEST_SUITE("U-Net through a pipe") {
  TEST_CASE("split 1, 2 and 3 ways, every mode: same output and input gradient as unsplit") {
    stagewise::testing::use_plain_convolutions();
    torch::manual_seed(0);
    UNet net;
    auto x = torch::randn({6, 2, 8, 8}, torch::requires_grad());
    auto expected = net.forward(x);
    expected.pow(2).sum().backward();
    const auto expected_grad = x.grad().clone();

    auto check = [&](auto pipe, sw::Checkpoint mode) {
      x.mutable_grad().reset();
      auto y = pipe->forward(x);
      CHECK(close(y, expected));
      y.pow(2).sum().backward();
      CHECK(close(x.grad(), expected_grad));
      (void)mode;
    };
    for (auto mode : modes) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(mode_name);
      const auto options = sw::PipeOptions().chunks(3).checkpoint(mode);
      check(
          sw::Pipe(sw::stages(sw::seq(net.d1, net.d2, net.mid, net.u2, net.u1, net.head)), options),
          mode);
      check(
          sw::Pipe(sw::stages(sw::seq(net.d1, net.d2, net.mid), sw::seq(net.u2, net.u1, net.head)),
                   options),
          mode);
      check(sw::Pipe(sw::stages(sw::seq(net.d1, net.d2), sw::seq(net.mid, net.u2),
                                sw::seq(net.u1, net.head)),
                     options),
            mode);
      torch::nn::Sequential seq(net.d1, net.d2, net.mid, net.u2, net.u1, net.head);
      check(sw::Pipe(seq, sw::balance{2, 2, 2}, options), mode);
      check(sw::Pipe(seq, sw::balance{1, 3, 1, 1}, options), mode);
    }
  }

  TEST_CASE("train_step split 1, 2 and 3 ways, every mode: same loss and gradients as unsplit") {
    stagewise::testing::use_plain_convolutions();
    torch::manual_seed(1);
    UNet net;
    auto x = torch::randn({6, 2, 8, 8});
    auto target = torch::randn({6, 2, 8, 8});
    auto params = net.parameters();
    const auto expected_loss = mse(net.forward(x), target);
    expected_loss.backward();
    std::vector<torch::Tensor> expected;
    for (auto& p : params) expected.push_back(p.grad().clone());

    auto check = [&](auto pipe) {
      net.zero_grad();
      auto loss = pipe->train_step(x, target, mse);
      CHECK(close(loss, expected_loss.detach()));
      for (std::size_t k = 0; k < params.size(); ++k) CHECK(close(params[k].grad(), expected[k]));
    };
    for (auto mode : modes) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(mode_name);
      const auto options = sw::PipeOptions().chunks(3).checkpoint(mode);
      check(sw::Pipe(sw::stages(sw::seq(net.d1, net.d2, net.mid, net.u2, net.u1, net.head)),
                     options));
      check(
          sw::Pipe(sw::stages(sw::seq(net.d1, net.d2, net.mid), sw::seq(net.u2, net.u1, net.head)),
                   options));
      check(sw::Pipe(
          sw::stages(sw::seq(net.d1, net.d2), sw::seq(net.mid, net.u2), sw::seq(net.u1, net.head)),
          options));
      torch::nn::Sequential seq(net.d1, net.d2, net.mid, net.u2, net.u1, net.head);
      check(sw::Pipe(seq, sw::balance{1, 1, 1, 1, 1, 1}, options));
    }
  }
}

TEST_SUITE("skips in a running pipe") {
  TEST_CASE("a stage that stashes a skip nobody declared is an error naming the stage") {
    auto stage0 = [](torch::Tensor x) {
      sw::stash<sx<E2>>(x);
      return x;
    };
    auto pipe = sw::Pipe(sw::stages(stage0, Stash<E1>(), Pop<E1>()), sw::PipeOptions().chunks(2));
    // The namespace's full name is pt::E2 behind this file's own enclosing namespaces (the test
    // binary's unity source wraps each file in one: tools/unity_source).
    const auto error = error_of([&] { pipe->forward(torch::rand({2, 1})); });
    CHECK(contains(error, "stagewise::stash: stage 0 stashes skip 'x' in namespace "));
    CHECK(contains(error, "pt::E2, which it does not declare"));
  }

  TEST_CASE("an exception in a stage of a train_step with skips is rethrown and nothing hangs") {
    struct Boom : std::runtime_error {
      using std::runtime_error::runtime_error;
    };
    auto fail = [](torch::Tensor) -> torch::Tensor { throw Boom("boom"); };
    auto pipe = sw::Pipe(sw::stages(Stash<E1>(), torch::nn::Linear(1, 1), fail, Pop<E1>()),
                         sw::PipeOptions().chunks(3));
    CHECK_THROWS_AS(pipe->train_step(torch::rand({3, 1}), torch::rand({3, 1}), mse), Boom);
    CHECK_THROWS_AS(pipe->forward(torch::rand({3, 1})), Boom);
  }

  TEST_CASE("a skip within a checkpointed stage is replayed by the recompute") {
    for (auto mode : modes) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(mode_name);
      torch::manual_seed(0);
      torch::nn::Linear linear(3, 3);
      auto pipe = sw::Pipe(sw::stages(sw::seq(Stash<E1>(), linear, Pop<E1>()), torch::nn::Tanh()),
                           sw::PipeOptions().chunks(2).checkpoint(mode));
      auto x = torch::randn({4, 3}, torch::requires_grad());
      auto expected = torch::tanh(x + linear(x));
      auto y = pipe->forward(x);
      CHECK(close(y, expected));
      y.sum().backward();
      auto grad = x.grad().clone();
      x.mutable_grad().reset();
      expected.sum().backward();
      CHECK(close(grad, x.grad()));
    }
  }
}
