#include "stagewise/pipe.hpp"

#include <torch/cuda.h>
#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <set>
#include <tuple>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {
struct PairImpl : torch::nn::Module {
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) { return {x, x * 2}; }
};
TORCH_MODULE(Pair);
struct AddImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor a, torch::Tensor b) { return a + b; }
};
TORCH_MODULE(Add);
struct CountImpl : torch::nn::Module {
  std::tuple<torch::Tensor, int64_t> forward(torch::Tensor x) { return {x, 1}; }
};
TORCH_MODULE(Count);

struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(torch::Tensor w) : weight(register_parameter("weight", w)) {}
  torch::Tensor forward(torch::Tensor x) { return x * weight; }
  torch::Tensor weight;
};
TORCH_MODULE(Scale);

torch::nn::Sequential three_linears() {
  return torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::Linear(2, 2), torch::nn::Linear(2, 2));
}
}  // namespace

// Stage concepts: both sides.
static_assert(sw::stage<torch::nn::Linear>);
static_assert(sw::stage<torch::nn::Sequential>);
static_assert(sw::stage<Pair>);
static_assert(sw::stage<Add>);
static_assert(!sw::stage<int>);
static_assert(!sw::stage<Count>);  // returns a non-tensor in its tuple
static_assert(sw::stage_of<Add, std::tuple<torch::Tensor, torch::Tensor>>);
static_assert(!sw::stage_of<torch::nn::Linear, std::tuple<torch::Tensor, torch::Tensor>>);
static_assert(std::is_same_v<sw::stage_list<Pair, Add>::output_type, torch::Tensor>);
static_assert(std::is_same_v<sw::stage_list<torch::nn::Linear, Pair>::output_type,
                             std::tuple<torch::Tensor, torch::Tensor>>);

TEST_SUITE("pipe construction") {
  TEST_CASE("parameters() is non-empty and the union of the stages' parameters") {
    auto seq = three_linears();
    auto pipe = sw::Pipe(seq, sw::balance{1, 2});
    auto params = pipe->parameters();
    CHECK(params.size() == 6);
    std::set<const void*> mine, theirs;
    for (auto& p : params) mine.insert(p.unsafeGetTensorImpl());
    for (auto& p : seq->parameters()) theirs.insert(p.unsafeGetTensorImpl());
    CHECK(mine == theirs);
  }

  TEST_CASE("indexing a pipe built from a Sequential walks the original layers") {
    auto seq = three_linears();
    auto pipe = sw::Pipe(seq, sw::balance{2, 1});
    REQUIRE(pipe->size() == 3);
    for (std::size_t i = 0; i < 3; ++i) CHECK(pipe->layer(i).get() == seq[i].get());
    std::size_t k = 0;
    for (const auto& layer : pipe->layers()) CHECK(layer.get() == seq[k++].get());
    CHECK(contains(error_of([&] { pipe->layer(3); }), "layer index 3 is out of range for a pipe of 3 layers"));
    CHECK(pipe->num_stages() == 2);
  }

  TEST_CASE("a typed stage list builds and runs, tuples flowing between stages") {
    auto pipe = sw::Pipe(sw::stages(torch::nn::Linear(3, 3), Pair(), Add()), sw::PipeOptions().chunks(2));
    static_assert(std::is_same_v<decltype(pipe), sw::Pipe<torch::nn::Linear, Pair, Add>>);
    auto x = torch::rand({4, 3});
    auto y = pipe->forward(x);
    CHECK(y.sizes() == torch::IntArrayRef{4, 3});
    CHECK(pipe->parameters().size() == 2);
  }

  TEST_CASE("balance errors name the problem and point at even_balance") {
    auto seq = three_linears();
    auto e = error_of([&] { sw::Pipe(seq, sw::balance{1, 1}); });
    CHECK(contains(e, "the balance adds up to 2 layers but the Sequential has 3"));
    CHECK(contains(e, "stagewise::even_balance"));
    CHECK(contains(error_of([&] { sw::Pipe(seq, sw::balance{2, 0, 1}); }),
                   "balance entry 1 is 0, but every stage needs at least one layer"));
    CHECK(contains(error_of([&] { sw::Pipe(seq, sw::balance{}); }),
                   "the balance is empty but the Sequential has 3 layers"));
    CHECK(sw::even_balance(6, 4) == sw::balance{2, 2, 1, 1});
    CHECK(contains(error_of([] { sw::even_balance(2, 3); }), "cannot split 2 layers into 3"));
  }

  TEST_CASE("chunks <= 0 and an unknown checkpoint mode are errors") {
    CHECK(contains(error_of([] { sw::PipeOptions().chunks(0); }), "chunks must be positive, got 0"));
    CHECK(contains(error_of([] { sw::PipeOptions().chunks(-2); }), "chunks must be positive, got -2"));
    CHECK(contains(error_of([] { sw::PipeOptions().checkpoint("sometimes"); }),
                   "unknown checkpoint mode 'sometimes'; use \"always\", \"except_last\" or \"never\""));
    CHECK(contains(error_of([] { sw::PipeOptions().checkpoint(static_cast<sw::Checkpoint>(7)); }),
                   "unknown checkpoint mode 7"));
    CHECK(sw::PipeOptions().checkpoint("never").checkpoint() == sw::Checkpoint::never);
  }

  TEST_CASE("more stages than devices is an error") {
    auto seq = three_linears();
    CHECK(contains(error_of([&] {
            sw::Pipe(seq, sw::balance{1, 1, 1}, sw::PipeOptions().devices({torch::kCPU, torch::kCPU}));
          }),
          "3 stages but only 2 devices; give one device per stage"));
  }

  TEST_CASE("more devices than stages is an error") {
    auto seq = three_linears();
    CHECK(contains(error_of([&] {
            sw::Pipe(seq, sw::balance{2, 1},
                     sw::PipeOptions().devices({torch::kCPU, torch::kCPU, torch::kCPU}));
          }),
          "stagewise::Pipe: 2 stages but 3 devices; give exactly one device per stage"));
  }

  TEST_CASE("a device that is neither the CPU nor CUDA is an error") {
    auto seq = three_linears();
    CHECK(contains(error_of([&] {
            sw::Pipe(seq, sw::balance{2, 1}, sw::PipeOptions().devices({torch::kCPU, torch::kMeta}));
          }),
          "stagewise::Pipe: stage 1 is given device meta; stages run on the CPU or on CUDA GPUs"));
  }

  TEST_CASE("a CUDA device on a machine without one is an error naming the fix") {
    if (torch::cuda::is_available()) return;  // the machine has one: nothing to refuse
    auto seq = three_linears();
    const auto text = error_of([&] {
      sw::Pipe(seq, sw::balance{2, 1},
               sw::PipeOptions().devices({torch::kCPU, torch::Device(torch::kCUDA, 0)}));
    });
    CHECK(contains(text, "stagewise::Pipe: stage 1 is given cuda:0 but no CUDA GPU is available"));
    CHECK(contains(text, "place it on torch::kCPU"));
    // Nothing was moved: the model is usable as it was.
    for (const auto& p : seq->parameters()) CHECK(p.device() == torch::Device(torch::kCPU));
  }

  TEST_CASE("a stage whose module spans two devices is an error when no devices are given") {
    // One parameter on the CPU and one on the meta device stand for a model split by hand.
    struct SplitImpl : torch::nn::Module {
      SplitImpl()
          : a(register_parameter("a", torch::ones({2}))),
            b(register_parameter("b", torch::empty({2}, torch::kMeta))) {}
      torch::Tensor forward(torch::Tensor x) { return x; }
      torch::Tensor a, b;
    };
    torch::nn::Sequential seq(torch::nn::Linear(2, 2), std::make_shared<SplitImpl>());
    CHECK(contains(error_of([&] { sw::Pipe(seq, sw::balance{1, 1}); }),
                   "stagewise::Pipe: stage 1 has tensors on cpu and on meta; a stage runs on one "
                   "device. Give PipeOptions().devices({...})"));
  }

  TEST_CASE("without devices each stage runs where its module is; with devices it is moved there") {
    auto seq = three_linears();
    auto pipe = sw::Pipe(seq, sw::balance{2, 1});
    CHECK(pipe->device(0) == torch::Device(torch::kCPU));
    CHECK(pipe->device(1) == torch::Device(torch::kCPU));
    auto pipe2 = sw::Pipe(three_linears(), sw::balance{1, 2},
                          sw::PipeOptions().devices({torch::kCPU, torch::kCPU}));
    CHECK(pipe2->device(1) == torch::Device(torch::kCPU));
  }

  TEST_CASE("the same child twice and a parameter shared by children are errors") {
    torch::nn::Linear shared(2, 2);
    torch::nn::Sequential twice(shared, shared);
    CHECK(contains(error_of([&] { sw::Pipe(twice, sw::balance{1, 1}); }),
                   "layers 0 and 1 of the Sequential are the same module"));
    auto w = torch::ones({2});
    torch::nn::Sequential tied{Scale(w), Scale(w)};
    CHECK(contains(error_of([&] { sw::Pipe(tied, sw::balance{1, 1}); }),
                   "layers 0 and 1 of the Sequential share a parameter"));
    CHECK(contains(error_of([&] { sw::Pipe(sw::stages(shared, shared)); }),
                   "stages 0 and 1 are the same module"));
  }

  TEST_CASE("every checkpoint mode constructs with chunks 1") {
    for (auto mode : {sw::Checkpoint::always, sw::Checkpoint::except_last, sw::Checkpoint::never}) {
      auto pipe = sw::Pipe(three_linears(), sw::balance{3}, sw::PipeOptions().chunks(1).checkpoint(mode));
      auto y = pipe->forward(torch::rand({2, 2}));
      y.sum().backward();
      CHECK(y.sizes() == torch::IntArrayRef{2, 2});
    }
  }

  TEST_CASE("moving the pipe to a device is refused; changing its dtype is allowed") {
    auto pipe = sw::Pipe(three_linears(), sw::balance{1, 2});
    CHECK(contains(error_of([&] { pipe->to(torch::kCPU); }),
                   "cannot move the pipe to cpu: each stage lives on the device it was given"));
    CHECK(contains(error_of([&] { pipe->to(torch::kCPU, torch::kDouble); }), "cannot move the pipe"));
    pipe->to(torch::kDouble);
    for (auto& p : pipe->parameters()) CHECK((p.scalar_type() == torch::kDouble));
  }

  TEST_CASE("an empty pipe returns its input unchanged") {
    auto pipe = sw::Pipe(torch::nn::Sequential(), sw::balance{});
    auto x = torch::rand({3});
    CHECK(pipe->forward(x).is_same(x));
  }

  TEST_CASE("a stage returning a non-tensor, or a tuple with one, is a clear error") {
    struct IntImpl : torch::nn::Module {
      int64_t forward(torch::Tensor) { return 3; }
    };
    struct MixedImpl : torch::nn::Module {
      std::tuple<torch::Tensor, double> forward(torch::Tensor x) { return {x, 1.0}; }
    };
    torch::nn::Sequential a;
    a->push_back(std::make_shared<IntImpl>());
    auto pa = sw::Pipe(a, sw::balance{1});
    CHECK(contains(error_of([&] { pa->forward(torch::rand({2})); }),
                   "stage 0 (layers 0..0) returned a long, not a torch::Tensor or a std::tuple of 2 to 4 Tensors"));
    torch::nn::Sequential b;
    b->push_back(std::make_shared<MixedImpl>());
    auto pb = sw::Pipe(b, sw::balance{1});
    CHECK(contains(error_of([&] { pb->forward(torch::rand({2})); }), "not a torch::Tensor"));
  }
}
