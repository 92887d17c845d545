#pragma once

// The per-parameter state of the optimizers optim::optimizer_for maps (SGD, Adam, AdamW, RMSprop,
// Adagrad) as plain tensors and a step count (optim::StateRecord), and back: what a store of
// optimizer state keeps (runtime::OffloadedState), and a deep copy of it.

#include "stagewise/optim/state_offload.hpp"

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>

namespace stagewise::detail {

enum class StateKind { sgd, adam, adamw, rmsprop, adagrad };

// The kind of state `optimizer` keeps per parameter; none for an optimizer stagewise cannot take
// apart (its state's fields are unknown).
inline std::optional<StateKind> state_kind_of(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return StateKind::sgd;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return StateKind::adam;
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return StateKind::adamw;
  if (dynamic_cast<const torch::optim::RMSprop*>(&optimizer)) return StateKind::rmsprop;
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer)) return StateKind::adagrad;
  return std::nullopt;
}

// The kind of state the optimizers `factory` builds (built once over a one-element tensor), or an
// error naming the optimizers a state offload takes.
inline StateKind state_kind_of(const optim::OptimizerFactory& factory, const std::string& who) {
  auto probe = torch::zeros({1}).requires_grad_(true);
  auto optimizer = factory({probe});
  TORCH_CHECK(optimizer != nullptr, who, ": the optimizer factory returned no optimizer");
  const auto kind = state_kind_of(*optimizer);
  const auto& o = *optimizer;
  TORCH_CHECK(kind.has_value(), who, ": the optimizer (", typeid(o).name(),
              ") keeps a state whose fields stagewise does not know, so it cannot move it off "
              "the device; offload the state of SGD, Adam, AdamW, RMSprop or Adagrad (the "
              "optimizers optim::optimizer_for maps), or keep this one's on the device");
  return *kind;
}

template <class State>
const State& state_as(const torch::optim::OptimizerParamState& s) {
  const auto* typed = dynamic_cast<const State*>(&s);
  TORCH_CHECK(typed != nullptr, "stagewise::optim: an optimizer state of type ", typeid(s).name(),
              " where ", typeid(State).name(), " was expected; one optimizer type per offload");
  return *typed;
}

// The record of `state` (its tensors shared, not copied).
inline optim::StateRecord record_of(StateKind kind,
                                    const torch::optim::OptimizerParamState& state) {
  switch (kind) {
    case StateKind::sgd:
      return {{state_as<torch::optim::SGDParamState>(state).momentum_buffer()}, 0};
    case StateKind::adam: {
      const auto& s = state_as<torch::optim::AdamParamState>(state);
      return {{s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}, s.step()};
    }
    case StateKind::adamw: {
      const auto& s = state_as<torch::optim::AdamWParamState>(state);
      return {{s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}, s.step()};
    }
    case StateKind::rmsprop: {
      const auto& s = state_as<torch::optim::RMSpropParamState>(state);
      return {{s.square_avg(), s.momentum_buffer(), s.grad_avg()}, s.step()};
    }
    case StateKind::adagrad: {
      const auto& s = state_as<torch::optim::AdagradParamState>(state);
      return {{s.sum()}, s.step()};
    }
  }
  TORCH_CHECK(false, "stagewise::optim: unknown optimizer state kind");
}

// The optimizer's state object holding `r`'s tensors (null for an empty record).
inline std::unique_ptr<torch::optim::OptimizerParamState> state_of(StateKind kind,
                                                                   optim::StateRecord r) {
  if (r.empty()) return nullptr;
  auto at = [&](std::size_t k) { return k < r.tensors.size() ? r.tensors[k] : torch::Tensor(); };
  switch (kind) {
    case StateKind::sgd: {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(at(0));
      return s;
    }
    case StateKind::adam: {
      auto s = std::make_unique<torch::optim::AdamParamState>();
      s->exp_avg(at(0)).exp_avg_sq(at(1)).max_exp_avg_sq(at(2)).step(r.step);
      return s;
    }
    case StateKind::adamw: {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->exp_avg(at(0)).exp_avg_sq(at(1)).max_exp_avg_sq(at(2)).step(r.step);
      return s;
    }
    case StateKind::rmsprop: {
      auto s = std::make_unique<torch::optim::RMSpropParamState>();
      s->square_avg(at(0)).momentum_buffer(at(1)).grad_avg(at(2)).step(r.step);
      return s;
    }
    case StateKind::adagrad: {
      auto s = std::make_unique<torch::optim::AdagradParamState>();
      s->sum(at(0)).step(r.step);
      return s;
    }
  }
  TORCH_CHECK(false, "stagewise::optim: unknown optimizer state kind");
}

// A record whose tensors are copies of `r`'s, on the CPU (a step may change them in place).
inline optim::StateRecord copy_to_host(const optim::StateRecord& r) {
  optim::StateRecord out;
  out.step = r.step;
  for (const auto& t : r.tensors) {
    out.tensors.push_back(t.defined() ? t.detach().to(torch::kCPU, /*non_blocking=*/false,
                                                      /*copy=*/true)
                                      : torch::Tensor());
  }
  return out;
}

}  // namespace stagewise::detail
