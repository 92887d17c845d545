#pragma once

#include "stagewise/core/phony.hpp"

#include <torch/autograd.h>
#include <torch/types.h>

#include <utility>

namespace stagewise {
namespace detail {

// Identity on `input`; also returns a phony whose gradient edge leads back here, so that any
// node joined to that phony must finish its backward before this node's backward may start.
struct ForkFunction : torch::autograd::Function<ForkFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                torch::Tensor input) {
    ctx->set_materialize_grads(false);
    return {input.detach(), phony(input.device(), /*requires_grad=*/false).detach()};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0]};
  }
};

// Identity on `input`; the phony input only adds an edge, and gets no gradient.
struct JoinFunction : torch::autograd::Function<JoinFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor input,
                               torch::Tensor /*phony*/) {
    ctx->set_materialize_grads(false);
    return input.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

}  // namespace detail

/// Splits `input` into (the same values, a phony) so that a later `join(other, phony)` orders
/// backward: `other`'s gradient path finishes before `input`'s backward begins.
///
/// Records nothing under no-grad or when `input` does not require grad; the phony then does not
/// require grad either, and `join` with it is a no-op.
///   auto [a2, p] = stagewise::fork(a);  b = stagewise::join(b, p);  // backward: b's path, then a's
inline std::pair<torch::Tensor, torch::Tensor> fork(const torch::Tensor& input) {
  if (torch::GradMode::is_enabled() && input.requires_grad()) {
    auto out = detail::ForkFunction::apply(input);
    return {out[0], out[1]};
  }
  return {input, phony(input.device(), /*requires_grad=*/false)};
}

/// Returns `input` unchanged, with an autograd edge to `phony` (see `fork`). The result requires
/// grad when `input` does or the phony does; under no-grad nothing is recorded.
inline torch::Tensor join(const torch::Tensor& input, const torch::Tensor& phony) {
  if (torch::GradMode::is_enabled() && (input.requires_grad() || phony.requires_grad())) {
    return detail::JoinFunction::apply(input, phony);
  }
  return input;
}

}  // namespace stagewise
