#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/core/detail/stage_spec.hpp"

#include <c10/util/Type.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace stagewise {

/// How many consecutive layers of a torch::nn::Sequential each stage takes, like torchgpipe's
/// `balance`. The entries must be positive and add up to the number of layers.
///   stagewise::Pipe(seq, stagewise::balance{2, 3, 1}, options)
struct balance : std::vector<int64_t> {
  using std::vector<int64_t>::vector;
};

/// Splits `layers` layers into `partitions` stages of near-equal size (earlier stages take the
/// remainder): even_balance(6, 4) == {2, 2, 1, 1}.
inline balance even_balance(int64_t layers, int64_t partitions) {
  TORCH_CHECK(partitions > 0, "stagewise::even_balance: partitions must be positive, got ",
              partitions);
  TORCH_CHECK(layers >= partitions, "stagewise::even_balance: cannot split ", layers,
              " layers into ", partitions, " non-empty stages; use at most ", layers, " stages");
  balance b;
  for (int64_t p = 0; p < partitions; ++p) b.push_back(layers / partitions + (p < layers % partitions));
  return b;
}

namespace detail {

// The checks torchgpipe makes on a Sequential before splitting it.
inline void verify_sequential(torch::nn::Sequential seq, const balance& b) {
  const int64_t n = static_cast<int64_t>(seq->size());
  std::map<const torch::nn::Module*, int64_t> seen;
  std::map<const c10::TensorImpl*, int64_t> owner;
  for (int64_t i = 0; i < n; ++i) {
    const auto* m = seq[i].get();
    auto [it, fresh] = seen.emplace(m, i);
    TORCH_CHECK(fresh, "stagewise::Pipe: layers ", it->second, " and ", i,
                " of the Sequential are the same module; a module may appear once. Use two "
                "modules, or call it twice inside one custom layer.");
    for (const auto& p : seq[i]->parameters()) {
      auto [o, fresh_param] = owner.emplace(p.unsafeGetTensorImpl(), i);
      TORCH_CHECK(fresh_param, "stagewise::Pipe: layers ", o->second, " and ", i,
                  " of the Sequential share a parameter; stages must own their parameters. Tie "
                  "them inside one layer instead.");
    }
  }
  const std::string helpers =
      "; give one positive entry per stage adding up to the number of layers, or split evenly "
      "with stagewise::even_balance(seq->size(), stages)";
  TORCH_CHECK(!(b.empty() && n > 0), "stagewise::Pipe: the balance is empty but the Sequential has ",
              n, " layers", helpers);
  for (std::size_t k = 0; k < b.size(); ++k) {
    TORCH_CHECK(b[k] > 0, "stagewise::Pipe: balance entry ", k, " is ", b[k],
                ", but every stage needs at least one layer", helpers);
  }
  const int64_t total = std::accumulate(b.begin(), b.end(), int64_t{0});
  TORCH_CHECK(total == n, "stagewise::Pipe: the balance adds up to ", total,
              " layers but the Sequential has ", n, helpers);
}

// A Sequential's output: a Tensor or a tuple of 2 to 4 Tensors.
inline Batch any_to_batch(torch::nn::AnyValue&& v, const std::string& where) {
  if (auto* t = v.try_get<torch::Tensor>()) return Batch(std::move(*t));
  if (auto* t = v.try_get<std::tuple<torch::Tensor, torch::Tensor>>()) {
    return Batch(std::vector<torch::Tensor>{std::get<0>(*t), std::get<1>(*t)});
  }
  if (auto* t = v.try_get<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>>()) {
    return Batch({std::get<0>(*t), std::get<1>(*t), std::get<2>(*t)});
  }
  if (auto* t = v.try_get<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>>()) {
    return Batch({std::get<0>(*t), std::get<1>(*t), std::get<2>(*t), std::get<3>(*t)});
  }
  TORCH_CHECK(false, "stagewise::Pipe: ", where, " returned a ", c10::demangle(v.type_info().name()),
              ", not a torch::Tensor or a std::tuple of 2 to 4 Tensors. Return tensors from the "
              "stage's last layer; keep other values inside the stage.");
}

inline torch::nn::AnyValue call_first(torch::nn::AnyModule& m, const Batch& b, bool unpack) {
  if (b.atomic()) return m.any_forward(b.tensor());
  const auto& t = b.tensors();
  // The pipe's own input is unpacked into arguments, like seq->forward(a, b); between stages a
  // tuple travels as one std::tuple argument, as inside a Sequential.
  switch (t.size()) {
    case 1: return m.any_forward(t[0]);
    case 2: return unpack ? m.any_forward(t[0], t[1]) : m.any_forward(std::make_tuple(t[0], t[1]));
    case 3:
      return unpack ? m.any_forward(t[0], t[1], t[2])
                    : m.any_forward(std::make_tuple(t[0], t[1], t[2]));
    case 4:
      return unpack ? m.any_forward(t[0], t[1], t[2], t[3])
                    : m.any_forward(std::make_tuple(t[0], t[1], t[2], t[3]));
    default: break;
  }
  TORCH_CHECK(false, "stagewise::Pipe: a Sequential stage takes at most 4 tensors, got ", t.size(),
              "; use the typed form stagewise::stages(...) with a std::vector<Tensor> stage");
}

// Splits a Sequential into stages along `b`; each stage is a new Sequential over the same layers.
inline std::vector<StageSpec> partition(torch::nn::Sequential seq, const balance& b) {
  verify_sequential(seq, b);
  std::vector<StageSpec> out;
  std::size_t next = 0;
  for (std::size_t k = 0; k < b.size(); ++k) {
    torch::nn::Sequential part;
    const std::size_t first = next;
    const auto names = seq->named_children();
    for (int64_t l = 0; l < b[k]; ++l, ++next) {
      part->push_back(names[next].key(), *(seq->begin() + static_cast<std::ptrdiff_t>(next)));
    }
    StageSpec spec;
    std::ostringstream name;
    name << "stage " << k << " (layers " << first << ".." << next - 1 << ")";
    spec.name = name.str();
    spec.module = part.ptr();
    spec.fn = [part, unpack = k == 0, where = spec.name](const Batch& in) mutable {
      auto it = part->begin();
      // Skippable layers have their stashes and pops checked while they run.
      torch::nn::AnyValue v =
          in_layer_frame(*it->ptr(), [&] { return call_first(*it, in, unpack); });
      for (++it; it != part->end(); ++it) {
        v = in_layer_frame(*it->ptr(), [&] { return it->any_forward(std::move(v)); });
      }
      return any_to_batch(std::move(v), where);
    };
    out.push_back(std::move(spec));
  }
  return out;
}

}  // namespace detail
}  // namespace stagewise
