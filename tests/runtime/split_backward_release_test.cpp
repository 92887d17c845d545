// After I, a SplitBackward keeps only what W reads (issue 44): the nodes only the input-gradient
// path runs release their saved tensors, the nodes where W starts keep theirs. For each kind of
// layer, and for the graphs where W and I share nodes, I + W still equal one backward bit for
// bit, and the storages I alone needed are gone before W while those W reads are not.
#include "stagewise/runtime/split_backward.hpp"

#include "tests/support/autocast.hpp"
#include "tests/support/grads.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

using stagewise::runtime::SplitBackward;
using Keep = stagewise::runtime::SplitBackward::Keep;

namespace {

using Fn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

// Watches a tensor's storage without keeping it: whether it has been freed.
struct Storage {
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> ptr;
  bool expired() const { return !ptr || ptr->expired(); }
};

Storage weak(const torch::Tensor& t) { return Storage{t.storage().getWeakStorageImpl()}; }

// Leaf copies of `xs`, each requiring grad as its original does.
std::vector<torch::Tensor> leaves(const std::vector<torch::Tensor>& xs) {
  std::vector<torch::Tensor> out;
  for (const auto& x : xs) out.push_back(x.detach().requires_grad_(x.requires_grad()));
  return out;
}

// Runs `f` once with one backward and once split into I and W (keeping `keep` between them), each
// on fresh leaves of `xs` with the same seed, and checks the inputs' and parameters' gradients
// bit for bit. `between` runs between I and W.
void check_exact(const Fn& f, const std::vector<torch::Tensor>& xs,
                 const std::vector<torch::Tensor>& params, Keep keep = Keep::what_w_reads,
                 const std::function<void()>& between = {}) {
  namespace t = stagewise::testing;
  t::zero_grads(params);
  auto x = leaves(xs);
  torch::manual_seed(11);
  auto ys = f(x);
  std::vector<torch::Tensor> gs;
  torch::manual_seed(12);
  for (const auto& y : ys) gs.push_back(torch::randn_like(y).to(y.dtype()));
  torch::autograd::backward(ys, gs);
  const auto expected = t::grads_of(params);
  const auto expected_dx = t::grads_of(x);
  t::zero_grads(params);
  ys.clear();

  auto x2 = leaves(xs);
  SplitBackward split(keep);
  torch::manual_seed(11);
  auto dx = split.input_grad(f(x2), gs, x2);
  REQUIRE(dx.size() == xs.size());
  for (std::size_t k = 0; k < dx.size(); ++k) {
    CAPTURE(k);
    REQUIRE(dx[k].defined() == expected_dx[k].defined());
    if (dx[k].defined()) CHECK(dx[k].equal(expected_dx[k]));
  }
  for (const auto& p : params) CHECK_FALSE(p.grad().defined());  // I leaves the weights alone
  if (between) between();
  split.weight_grad();
  const auto got = t::grads_of(params);
  for (std::size_t k = 0; k < params.size(); ++k) {
    CAPTURE(k);
    REQUIRE(got[k].defined() == expected[k].defined());
    if (got[k].defined()) CHECK(got[k].equal(expected[k]));
  }
}

std::vector<torch::Tensor> params_of(std::initializer_list<torch::nn::Module*> modules) {
  std::vector<torch::Tensor> out;
  for (auto* m : modules) {
    for (const auto& p : m->parameters()) out.push_back(p);
  }
  return out;
}

// Causal self-attention with one head per 4 features: q, k, v and the output projection are W's
// starts; the scores, the softmax's probabilities and the masked fill are I's alone. `probs` and
// `proj_in` receive the probabilities and the projection's input of the last call.
struct Attention {
  torch::nn::Linear qkv{16, 48};
  torch::nn::Linear proj{16, 16};
  torch::Tensor probs, proj_in;
  torch::Tensor operator()(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1);
    auto parts = qkv(x).view({b, t, 3, 4, 4}).permute({2, 0, 3, 1, 4});
    auto scores = torch::matmul(parts[0], parts[1].transpose(-2, -1)) / 2.0;
    auto mask = torch::ones({t, t}, torch::kBool).tril();
    probs = torch::softmax(scores.masked_fill(mask.logical_not(), -INFINITY), -1);
    proj_in = torch::matmul(probs, parts[2]).transpose(1, 2).reshape({b, t, 16});
    return proj(proj_in);
  }
};

}  // namespace

TEST_SUITE("split backward keeps what W reads") {
  TEST_CASE("linear layers with GELU, Tanh and ReLU: exact, and each activation's input is freed") {
    torch::manual_seed(0);
    torch::nn::Linear a(8, 32), b(32, 32), c(32, 32), d(32, 8);
    Storage gelu_in, gelu_out;
    auto f = [&](const std::vector<torch::Tensor>& x) {
      auto h = a(x[0]);
      gelu_in = weak(h);
      auto g = torch::gelu(h);
      gelu_out = weak(g);
      return std::vector<torch::Tensor>{d(torch::relu(c(torch::tanh(b(g)))))};
    };
    check_exact(f, {torch::randn({6, 8}, torch::requires_grad())}, params_of({&*a, &*b, &*c, &*d}),
                Keep::what_w_reads, [&] {
                  CHECK(gelu_in.expired());       // GELU's saved input: only I reads it
                  CHECK_FALSE(gelu_out.expired());  // b's input: W reads it
                });
    CHECK(gelu_out.expired());  // W consumed the graph
  }

  TEST_CASE("keeping the whole graph keeps I's tensors until W, with the same gradients") {
    torch::manual_seed(1);
    torch::nn::Linear a(8, 32), b(32, 8);
    Storage gelu_in;
    auto f = [&](const std::vector<torch::Tensor>& x) {
      auto h = a(x[0]);
      gelu_in = weak(h);
      return std::vector<torch::Tensor>{b(torch::gelu(h))};
    };
    check_exact(f, {torch::randn({6, 8}, torch::requires_grad())}, params_of({&*a, &*b}),
                Keep::whole_graph, [&] { CHECK_FALSE(gelu_in.expired()); });
    CHECK(gelu_in.expired());
    const auto old = SplitBackward::set_default_keep(Keep::whole_graph);
    CHECK(old == Keep::what_w_reads);
    CHECK(SplitBackward::default_keep() == Keep::whole_graph);
    check_exact(f, {torch::randn({6, 8}, torch::requires_grad())}, params_of({&*a, &*b}),
                SplitBackward::default_keep(), [&] { CHECK_FALSE(gelu_in.expired()); });
    SplitBackward::set_default_keep(old);
    CHECK(SplitBackward::default_keep() == Keep::what_w_reads);
  }

  TEST_CASE("attention (matmul, bmm, masked softmax): exact, and the probabilities are freed") {
    torch::manual_seed(2);
    Attention attn;
    auto f = [&](const std::vector<torch::Tensor>& x) {
      return std::vector<torch::Tensor>{attn(x[0])};
    };
    Storage probs, proj_in;
    check_exact(f, {torch::randn({2, 5, 16}, torch::requires_grad())},
                params_of({&*attn.qkv, &*attn.proj}), Keep::what_w_reads, [&] {
                  probs = weak(attn.probs);
                  proj_in = weak(attn.proj_in);
                  attn.probs = attn.proj_in = torch::Tensor();
                  CHECK(probs.expired());            // softmax's and the bmm's: I's alone
                  CHECK_FALSE(proj_in.expired());    // the projection's input: W reads it
                });
    CHECK(proj_in.expired());
  }

  TEST_CASE("convolutions, layer and RMS norms (a weight on the input path) and bmm are exact") {
    torch::manual_seed(3);
    torch::nn::Conv2d conv1(torch::nn::Conv2dOptions(2, 4, 3).padding(1));
    torch::nn::Conv2d conv2(torch::nn::Conv2dOptions(4, 2, 3));
    auto f = [&](const std::vector<torch::Tensor>& x) {
      return std::vector<torch::Tensor>{conv2(torch::relu(conv1(x[0])))};
    };
    check_exact(f, {torch::randn({2, 2, 6, 6}, torch::requires_grad())},
                params_of({&*conv1, &*conv2}));

    torch::nn::Linear a(8, 8), b(8, 8);
    torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({8}));
    auto rms_w = torch::randn({8}, torch::requires_grad());
    auto m = torch::randn({8, 8}, torch::requires_grad());
    Storage ln_in;
    auto g = [&](const std::vector<torch::Tensor>& x) {
      auto h = a(x[0]);
      ln_in = weak(h);
      auto n = ln(h);
      auto r = n * torch::rsqrt(n.pow(2).mean(-1, true) + 1e-5) * rms_w;
      return std::vector<torch::Tensor>{torch::bmm(b(r), m.expand({3, 8, 8}))};
    };
    auto params = params_of({&*a, &*b, &*ln});
    params.push_back(rms_w);
    params.push_back(m);
    check_exact(g, {torch::randn({3, 4, 8}, torch::requires_grad())}, params, Keep::what_w_reads,
                [&] { CHECK_FALSE(ln_in.expired()); });  // the norm's weight gradient reads it
  }

  TEST_CASE("embedding, dropout and a weight used twice are exact") {
    torch::manual_seed(4);
    torch::nn::Embedding emb(10, 8);
    torch::nn::Linear a(8, 8);
    torch::nn::Dropout drop(0.5);
    const auto ids = torch::randint(10, {3, 4});
    auto f = [&](const std::vector<torch::Tensor>& x) {
      auto h = a(torch::gelu(a(emb(ids) + x[0])));  // a twice, on the input path both times
      return std::vector<torch::Tensor>{drop(h) * 2.0};
    };
    check_exact(f, {torch::randn({3, 4, 8}, torch::requires_grad())}, params_of({&*emb, &*a}));
  }

  TEST_CASE("tied embedding and head, and an input with a second output (a skip) are exact") {
    torch::manual_seed(5);
    torch::nn::Embedding emb(12, 8);
    torch::nn::Linear mid(8, 8), side(8, 8);
    const auto ids = torch::randint(12, {2, 3});
    auto f = [&](const std::vector<torch::Tensor>& x) {
      auto h = torch::tanh(mid(emb(ids) + x[0])) + side(x[1]);  // x[1]: a skip popped here
      auto logits = torch::matmul(h, emb->weight.t());          // the head is the embedding
      auto stash = torch::gelu(mid(h));                         // sent on as a skip, with a gradient
      return std::vector<torch::Tensor>{logits, stash};
    };
    check_exact(f,
                {torch::randn({2, 3, 8}, torch::requires_grad()),
                 torch::randn({2, 3, 8}, torch::requires_grad())},
                params_of({&*emb, &*mid, &*side}));
  }

  TEST_CASE("under CPU autocast (bf16 casts on both paths) I + W are exact") {
    torch::manual_seed(6);
    torch::nn::Linear a(8, 16), b(16, 8);
    auto f = [&](const std::vector<torch::Tensor>& x) {
      stagewise::testing::CpuAutocastRegion region;
      return std::vector<torch::Tensor>{b(torch::gelu(a(x[0]))).to(torch::kFloat)};
    };
    check_exact(f, {torch::randn({4, 8}, torch::requires_grad())}, params_of({&*a, &*b}));
  }
}
