// The decoder-only transformer of examples/gpt.cpp, written with plain LibTorch modules: token
// embedding, blocks of causal multi-head attention with rotary position embeddings (RoPE) and an
// MLP, each after an RMSNorm, and a language-model head. Byte-level: the vocabulary is 256 bytes,
// byte 0 starts a document.
//
// The model is a torch::nn::Sequential ("embed", "block0" .. "blockN-1", "head") so that a pipe can
// split it anywhere (balance_by_time). The RoPE tables and the causal mask are buffers of the
// embedding layer, made once; each step the embedding stashes them, with the int64 token ids, for
// every block under the block's own skip namespace (Layer<i>), and each block pops its four. So
// whichever stage a block lands in, the skips carry exactly what it needs from stage 0.
#pragma once

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

namespace gpt {

namespace sw = stagewise;

/// The model's shape. `max_layers` bounds `layers`: each block's skip namespace is a type.
struct Config {
  int64_t vocab = 256;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t layers = 4;
  int64_t context = 64;
  double rope_base = 10000.0;
  static constexpr int max_layers = 12;
  int64_t head_dim() const { return dim / heads; }
};

/// The skip namespace of block I: its tables, mask and ids are its own skips.
template <int I>
struct Layer {};
template <class L>
using rope_cos = sw::skip<L, "rope_cos">;
template <class L>
using rope_sin = sw::skip<L, "rope_sin">;
template <class L>
using causal_mask = sw::skip<L, "causal_mask">;
template <class L>
using token_ids = sw::skip<L, "token_ids">;

/// Rotates the two halves of the last dimension of `x` [b, h, T, d] by the angles whose cosines
/// and sines are `cos`, `sin` [T, d/2] (the GPT-NeoX layout).
inline torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos,
                                const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  auto x1 = x.narrow(-1, 0, half);
  auto x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

/// Where a token may attend: earlier tokens (the causal mask [T, T]) of its own document (a
/// document starts at each byte 0 of `ids` [b, T]). Returns [b, 1, T, T].
inline torch::Tensor document_mask(const torch::Tensor& causal, const torch::Tensor& ids) {
  auto doc = ids.eq(0).cumsum(1);
  return causal.logical_and(doc.unsqueeze(2).eq(doc.unsqueeze(1))).unsqueeze(1);
}

struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t dim) : weight(register_parameter("weight", torch::ones({dim}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-5) * weight;
  }
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

inline torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const Config& c)
      : heads(c.heads),
        qkv(register_module("qkv", linear(c.dim, 3 * c.dim))),
        proj(register_module("proj", linear(c.dim, c.dim))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    auto parts = qkv(x).view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
    auto q = apply_rope(parts[0], cos, sin);
    auto k = apply_rope(parts[1], cos, sin);
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(d / heads));
    auto weights = torch::softmax(scores.masked_fill(mask.logical_not(), -INFINITY), -1);
    return proj(torch::matmul(weights, parts[2]).transpose(1, 2).reshape({b, t, d}));
  }
  int64_t heads;
  torch::nn::Linear qkv, proj;
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const Config& c)
      : fc(register_module("fc", linear(c.dim, 4 * c.dim))),
        out(register_module("out", linear(4 * c.dim, c.dim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return out(torch::gelu(fc(x))); }
  torch::nn::Linear fc, out;
};
TORCH_MODULE(Mlp);

/// Block I: pre-norm attention and MLP, each with a residual; pops its tables, mask and ids.
template <class L>
struct BlockImpl
    : sw::Skippable<BlockImpl<L>, sw::pops<rope_cos<L>, rope_sin<L>, causal_mask<L>, token_ids<L>>> {
  explicit BlockImpl(const Config& c)
      : norm1(this->register_module("norm1", RMSNorm(c.dim))),
        attn(this->register_module("attn", Attention(c))),
        norm2(this->register_module("norm2", RMSNorm(c.dim))),
        mlp(this->register_module("mlp", Mlp(c))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto cos = sw::pop<rope_cos<L>>(this);
    auto sin = sw::pop<rope_sin<L>>(this);
    auto mask = document_mask(sw::pop<causal_mask<L>>(this), sw::pop<token_ids<L>>(this));
    x = x + attn(norm1(x), cos.to(x.dtype()), sin.to(x.dtype()), mask);
    return x + mlp(norm2(x));
  }
  RMSNorm norm1;
  Attention attn;
  RMSNorm norm2;
  Mlp mlp;
};
template <class L>
using Block = torch::nn::ModuleHolder<BlockImpl<L>>;

template <class Seq>
struct embed_stashes;
template <int... I>
struct embed_stashes<std::integer_sequence<int, I...>> {
  using type = sw::stashes<rope_cos<Layer<I>>..., rope_sin<Layer<I>>..., causal_mask<Layer<I>>...,
                           token_ids<Layer<I>>...>;
};

/// The token embedding of a model with N blocks; holds the RoPE tables and the causal mask
/// (buffers, made once) and stashes them with the ids for each block.
template <int N>
struct EmbedImpl
    : sw::Skippable<EmbedImpl<N>,
                    typename embed_stashes<std::make_integer_sequence<int, N>>::type> {
  explicit EmbedImpl(const Config& c)
      : tok(this->register_module("tok", torch::nn::Embedding(c.vocab, c.dim))) {
    const int64_t half = c.head_dim() / 2;
    auto inv_freq =
        torch::pow(c.rope_base, -torch::arange(half, torch::kDouble) / double(half));
    auto angles = torch::outer(torch::arange(c.context, torch::kDouble), inv_freq);
    cos = this->register_buffer("rope_cos", angles.cos().to(torch::kFloat));
    sin = this->register_buffer("rope_sin", angles.sin().to(torch::kFloat));
    causal = this->register_buffer(
        "causal_mask", torch::ones({c.context, c.context}, torch::kBool).tril());
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    const int64_t t = ids.size(1);
    TORCH_CHECK(t <= cos.size(0), "gpt: a sequence of ", t, " tokens is longer than the context ",
                cos.size(0), "; raise --context or cut the input");
    stash_all(ids, cos.narrow(0, 0, t), sin.narrow(0, 0, t),
              causal.narrow(0, 0, t).narrow(1, 0, t), std::make_integer_sequence<int, N>{});
    return tok(ids);
  }
  template <int... I>
  void stash_all(const torch::Tensor& ids, const torch::Tensor& c, const torch::Tensor& s,
                 const torch::Tensor& m, std::integer_sequence<int, I...>) {
    ((sw::stash<rope_cos<Layer<I>>>(this, c), sw::stash<rope_sin<Layer<I>>>(this, s),
      sw::stash<causal_mask<Layer<I>>>(this, m), sw::stash<token_ids<Layer<I>>>(this, ids)),
     ...);
  }
  torch::nn::Embedding tok;
  torch::Tensor cos, sin, causal;
};
template <int N>
using Embed = torch::nn::ModuleHolder<EmbedImpl<N>>;

struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(const Config& c)
      : norm(register_module("norm", RMSNorm(c.dim))), lm(register_module("lm", linear(c.dim, c.vocab))) {}
  torch::Tensor forward(const torch::Tensor& x) { return lm(norm(x)); }
  RMSNorm norm;
  torch::nn::Linear lm;
};
TORCH_MODULE(Head);

namespace detail {
// The block and embedding types are templates over a compile-time index: these walk 0..max to
// reach the runtime one.
template <int I>
void add_blocks(torch::nn::Sequential& seq, const Config& c) {
  if constexpr (I < Config::max_layers) {
    if (I >= c.layers) return;
    seq->push_back("block" + std::to_string(I), Block<Layer<I>>(c));
    add_blocks<I + 1>(seq, c);
  }
}
template <int N>
void add_embed(torch::nn::Sequential& seq, const Config& c) {
  if constexpr (N <= Config::max_layers) {
    if (N == c.layers) {
      seq->push_back("embed", Embed<N>(c));
    } else {
      add_embed<N + 1>(seq, c);
    }
  }
}
}  // namespace detail

/// Checks a configuration; every problem is an error naming the flag that sets it.
inline void check(const Config& c) {
  TORCH_CHECK(c.layers >= 1 && c.layers <= Config::max_layers, "gpt: --layers must be 1 to ",
              Config::max_layers, ", got ", c.layers);
  TORCH_CHECK(c.heads >= 1 && c.dim >= 1 && c.dim % c.heads == 0 && c.head_dim() % 2 == 0,
              "gpt: --dim (", c.dim, ") must be a multiple of --heads (", c.heads,
              ") with an even quotient (RoPE rotates pairs)");
  TORCH_CHECK(c.context >= 2, "gpt: --context must be at least 2, got ", c.context);
}

/// The model, as the Sequential a pipe splits: "embed", "block0" .. "block<L-1>", "head".
inline torch::nn::Sequential make_model(const Config& c) {
  check(c);
  torch::nn::Sequential seq;
  detail::add_embed<1>(seq, c);
  detail::add_blocks<0>(seq, c);
  seq->push_back("head", Head(c));
  return seq;
}

/// Next-byte cross entropy over every position: logits [b, T, V], targets [b, T] (int64).
inline torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1).to(torch::kFloat), targets.flatten());
}

}  // namespace gpt
