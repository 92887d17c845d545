#pragma once

// A small U-Net's levels for the skip tests: each encoder level stashes its features in its own
// skip namespace `Level`, and the decoder level of that namespace pops them.

#include "stagewise/skip/skippable.hpp"

#include <torch/torch.h>

#include <cstdint>

namespace stagewise::testing {

template <class Level>
using skip_h = skip<Level, "h">;

/// Encoder level: a 3x3 convolution and ReLU whose output is stashed, then 2x2 max pooling.
template <class Level>
struct DownImpl : Skippable<DownImpl<Level>, stashes<skip_h<Level>>> {
  DownImpl(int64_t in, int64_t out)
      : conv(this->register_module(
            "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(conv(x));
    stagewise::stash<skip_h<Level>>(this, h);
    return torch::max_pool2d(h, 2);
  }
  torch::nn::Conv2d conv;
};
template <class Level>
using Down = torch::nn::ModuleHolder<DownImpl<Level>>;

/// Decoder level: upsamples, concatenates the popped encoder features, 3x3 convolution and ReLU.
template <class Level>
struct UpImpl : Skippable<UpImpl<Level>, pops<skip_h<Level>>> {
  UpImpl(int64_t in, int64_t skip, int64_t out)
      : conv(this->register_module(
            "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in + skip, out, 3).padding(1)))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto up = torch::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2});
    return torch::relu(conv(torch::cat({up, stagewise::pop<skip_h<Level>>(this)}, 1)));
  }
  torch::nn::Conv2d conv;
};
template <class Level>
using Up = torch::nn::ModuleHolder<UpImpl<Level>>;

}  // namespace stagewise::testing
