#pragma once

#include "stagewise/core/phony.hpp"
#include "stagewise/runtime/stream.hpp"
#include "stagewise/skip/namespace.hpp"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <mutex>
#include <utility>

namespace stagewise::runtime::detail {

/// Carries one micro-batch's skip tensor from the stage that stashes it to the stage that pops
/// it, hidden from autograd's data path (torchgpipe's portal).
///
/// The tensor may be taken `tensor_life` times and is dropped at the last take, so it is freed
/// as early as possible. Its takers: the stash's `blue` (1) and the pop's `orange` (1); under
/// checkpointing the recomputed pop takes it once more (so 3 on stash), and the recomputed
/// stash puts it back with life 1 for its own `blue`. The gradient of the popped tensor waits in
/// the portal from the pop's backward until the stash's backward takes it.
class Portal : public torch::CustomClassHolder {
 public:
  Portal(const SkipInfo& skip, torch::Tensor tensor, int tensor_life) : skip_(&skip) {
    put_tensor(std::move(tensor), tensor_life);
  }

  /// Stores `tensor`, to be taken `tensor_life` times.
  void put_tensor(torch::Tensor tensor, int tensor_life) {
    std::lock_guard<std::mutex> lock(mutex_);
    life_ = tensor_life;
    tensor_ = life_ > 0 ? std::move(tensor) : torch::Tensor();
  }

  /// Takes the tensor once; after the last take the portal no longer holds it.
  torch::Tensor use_tensor() {
    std::lock_guard<std::mutex> lock(mutex_);
    check_life();
    torch::Tensor out = tensor_;
    if (--life_ <= 0) tensor_ = torch::Tensor();
    return out;
  }

  /// Replaces the held tensor without taking it (a copy to another device).
  template <class F>
  void transform_tensor(F&& f) {
    std::lock_guard<std::mutex> lock(mutex_);
    check_life();
    tensor_ = f(tensor_);
  }

  void put_grad(torch::Tensor grad) {
    std::lock_guard<std::mutex> lock(mutex_);
    grad_ = std::move(grad);
  }
  /// Takes the gradient; undefined when the popped tensor got none (e.g. it was used only
  /// without gradient), which is not an error.
  torch::Tensor use_grad() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(grad_, torch::Tensor());
  }
  template <class F>
  void transform_grad(F&& f) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (grad_.defined()) grad_ = f(grad_);
  }

  /// How many more times the tensor may be taken (0: it has been released).
  int tensor_life() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return life_;
  }
  /// True while the portal holds the tensor.
  bool has_tensor() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return tensor_.defined();
  }
  const SkipInfo& skip() const { return *skip_; }

 private:
  void check_life() const {
    TORCH_CHECK(life_ > 0, "stagewise: the tensor of skip ", skip_->describe(),
                " was taken from its portal more often than its life allows (it has been "
                "released). This is a bug in stagewise; please report it with the pipe's layout.");
  }

  const SkipInfo* skip_;
  mutable std::mutex mutex_;
  torch::Tensor tensor_;
  int life_ = 0;
  torch::Tensor grad_;
};

inline c10::intrusive_ptr<Portal> portal_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<Portal>(ctx->saved_data["portal"].toCapsule());
}

// Hides the stashed tensor: its output is a phony to join into the stashing stage's output, and
// its backward hands the gradient that the pop left in the portal to the stashed tensor.
struct PortalBlueFunction : torch::autograd::Function<PortalBlueFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor tensor,
                               c10::intrusive_ptr<Portal> portal) {
    ctx->saved_data["portal"] = c10::IValue::make_capsule(std::move(portal));
    ctx->set_materialize_grads(false);
    return phony(tensor.device(), /*requires_grad=*/false).detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    return {portal_of(ctx)->use_grad(), torch::Tensor()};
  }
};

// Brings the tensor out again at the popping stage, from a phony forked off that stage's input;
// its backward leaves the popped tensor's gradient in the portal.
struct PortalOrangeFunction : torch::autograd::Function<PortalOrangeFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor /*phony*/,
                               c10::intrusive_ptr<Portal> portal) {
    torch::Tensor out = portal->use_tensor().detach();
    ctx->saved_data["portal"] = c10::IValue::make_capsule(std::move(portal));
    ctx->set_materialize_grads(false);
    if (!out.is_floating_point() && !out.is_complex()) ctx->mark_non_differentiable({out});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (grads[0].defined()) portal_of(ctx)->put_grad(grads[0]);
    return {torch::Tensor(), torch::Tensor()};
  }
};

// Where a cross-device portal copy goes: devices and streams on both sides.
struct PortalRoute : torch::CustomClassHolder {
  PortalRoute(torch::Device from, c10::Stream from_compute, c10::Stream from_copy, torch::Device to,
              c10::Stream to_copy, c10::Stream to_compute)
      : from_device(from),
        from_compute(from_compute),
        from_copy(from_copy),
        to_device(to),
        to_copy(to_copy),
        to_compute(to_compute) {}
  torch::Device from_device;
  c10::Stream from_compute, from_copy;
  torch::Device to_device;
  c10::Stream to_copy, to_compute;
};

// Moves the portal's tensor to the popping stage's device (on its copy stream) and, in
// backward, the gradient back to the stashing stage's device.
struct PortalCopyFunction : torch::autograd::Function<PortalCopyFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor /*phony*/,
                               c10::intrusive_ptr<Portal> portal,
                               c10::intrusive_ptr<PortalRoute> route) {
    portal->transform_tensor([&](const torch::Tensor& t) {
      return runtime::copy_to(t, route->to_device, route->from_compute, route->to_copy,
                              route->to_compute);
    });
    ctx->saved_data["portal"] = c10::IValue::make_capsule(std::move(portal));
    ctx->saved_data["route"] = c10::IValue::make_capsule(route);
    ctx->set_materialize_grads(false);
    return phony(route->to_device, /*requires_grad=*/false).detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    auto route =
        c10::static_intrusive_pointer_cast<PortalRoute>(ctx->saved_data["route"].toCapsule());
    portal_of(ctx)->transform_grad([&](const torch::Tensor& g) {
      return runtime::copy_to(g, route->from_device, route->to_compute, route->from_copy,
                              route->from_compute);
    });
    return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

/// Takes the tensor for the stash side and returns a phony to join into the stashing stage's
/// output, so the stash's backward waits for the gradient the pop leaves in the portal.
inline torch::Tensor portal_blue(const c10::intrusive_ptr<Portal>& portal) {
  torch::Tensor tensor = portal->use_tensor();
  if (!tensor.defined()) return phony(torch::kCPU, /*requires_grad=*/false);
  return PortalBlueFunction::apply(tensor, portal);
}

/// Takes the tensor for the pop side, connected to autograd through `phony` (forked off the
/// popping stage's input).
inline torch::Tensor portal_orange(const c10::intrusive_ptr<Portal>& portal,
                                   const torch::Tensor& phony) {
  return PortalOrangeFunction::apply(phony, portal);
}

/// Copies the portal's tensor between devices; returns a phony to join into the receiving
/// micro-batch (after a fork of it, passed as `phony`).
inline torch::Tensor portal_copy(const c10::intrusive_ptr<Portal>& portal,
                                 const torch::Tensor& phony,
                                 const c10::intrusive_ptr<PortalRoute>& route) {
  return PortalCopyFunction::apply(phony, portal, route);
}

}  // namespace stagewise::runtime::detail
