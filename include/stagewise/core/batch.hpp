#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace stagewise {

/// What flows between stages: either one tensor ("atomic") or a tuple of tensors.
///
/// A Batch never holds a non-tensor: building one from an IValue that is not a Tensor or a tuple
/// of Tensors is an error that names the offending element.
///   stagewise::Batch b(x);              // atomic: b.tensor(), b[0]
///   stagewise::Batch t({x, mask});      // tuple:  t.tensors(), t[1]
class Batch {
 public:
  /// An atomic batch holding one tensor.
  Batch(torch::Tensor tensor) : values_{std::move(tensor)}, atomic_(true) {}  // NOLINT(implicit)

  /// A tuple batch; it needs at least one tensor.
  explicit Batch(std::vector<torch::Tensor> tensors) : values_(std::move(tensors)), atomic_(false) {
    TORCH_CHECK(!values_.empty(),
                "stagewise::Batch: a tuple batch needs at least one tensor; pass a tensor "
                "directly for a single value");
  }

  /// Converts a stage's IValue result: a Tensor gives an atomic batch, a tuple or list of
  /// Tensors a tuple batch. `where` names the producer in the error message.
  static Batch from_ivalue(const c10::IValue& value, const std::string& where = "a stage") {
    if (value.isTensor()) return Batch(value.toTensor());
    std::vector<c10::IValue> elements;
    if (value.isTuple()) {
      elements = value.toTupleRef().elements().vec();
    } else if (value.isTensorList()) {
      for (const auto& t : value.toTensorVector()) elements.emplace_back(t);
    } else if (value.isList()) {
      elements = value.toListRef().vec();
    } else {
      TORCH_CHECK(false, "stagewise::Batch: ", where, " produced a ", value.tagKind(),
                  ", not a Tensor or a tuple of Tensors. Stages must take and return tensors; "
                  "keep other values inside the stage or encode them as tensors.");
    }
    std::vector<torch::Tensor> tensors;
    tensors.reserve(elements.size());
    for (std::size_t i = 0; i < elements.size(); ++i) {
      TORCH_CHECK(elements[i].isTensor(), "stagewise::Batch: element ", i, " of the tuple from ",
                  where, " is a ", elements[i].tagKind(),
                  ", not a Tensor. Stages must take and return tensors; keep other values inside "
                  "the stage or encode them as tensors.");
      tensors.push_back(elements[i].toTensor());
    }
    return Batch(std::move(tensors));
  }

  /// True when the batch holds one tensor rather than a tuple.
  bool atomic() const { return atomic_; }

  /// Number of tensors (1 for an atomic batch).
  std::size_t size() const { return values_.size(); }

  /// The tensor of an atomic batch.
  const torch::Tensor& tensor() const {
    TORCH_CHECK(atomic_, "stagewise::Batch::tensor(): this batch is a tuple of ", size(),
                " tensors, not atomic; use tensors() or operator[]");
    return values_.front();
  }

  /// The tensors of a tuple batch.
  const std::vector<torch::Tensor>& tensors() const {
    TORCH_CHECK(!atomic_,
                "stagewise::Batch::tensors(): this batch is atomic (one tensor), not a tuple; "
                "use tensor() or operator[](0)");
    return values_;
  }

  /// The i-th tensor (only 0 for an atomic batch).
  const torch::Tensor& operator[](std::size_t i) const {
    check_index(i);
    return values_[i];
  }

  /// Replaces the i-th tensor (only 0 for an atomic batch).
  void set(std::size_t i, torch::Tensor value) {
    check_index(i);
    values_[i] = std::move(value);
  }

  /// Replaces every tensor at once; an atomic batch takes exactly one.
  void set(std::vector<torch::Tensor> values) {
    if (atomic_) {
      TORCH_CHECK(values.size() == 1, "stagewise::Batch::set: an atomic batch holds exactly one "
                  "tensor, got ", values.size());
    } else {
      TORCH_CHECK(!values.empty(), "stagewise::Batch::set: a tuple batch needs at least one tensor");
    }
    values_ = std::move(values);
  }

  auto begin() const { return values_.begin(); }
  auto end() const { return values_.end(); }

  /// The batch as a stage argument: a Tensor, or a tuple of Tensors.
  c10::IValue to_ivalue() const {
    if (atomic_) return c10::IValue(values_.front());
    std::vector<c10::IValue> elements(values_.begin(), values_.end());
    return c10::IValue(c10::ivalue::Tuple::create(std::move(elements)));
  }

 private:
  void check_index(std::size_t i) const {
    TORCH_CHECK_INDEX(i < values_.size(), "stagewise::Batch: index ", i, " is out of range for ",
                      atomic_ ? "an atomic batch (only index 0)" : "a tuple batch of ",
                      atomic_ ? std::string() : std::to_string(values_.size()) + " tensors");
  }

  std::vector<torch::Tensor> values_;
  bool atomic_;
};

/// Splits a batch into at most `chunks` micro-batches along dimension 0, tensor by tensor.
///
/// Like torch::chunk, a batch that is smaller than `chunks` or not divisible gives fewer or uneven
/// micro-batches. Every tensor of a tuple must have the same size in dimension 0.
///   auto micro = stagewise::scatter(Batch(x), 4);  // x of 7 rows: sizes 2, 2, 2, 1
inline std::vector<Batch> scatter(const Batch& batch, int64_t chunks) {
  TORCH_CHECK(chunks > 0, "stagewise::scatter: chunks must be positive, got ", chunks);
  std::vector<std::vector<torch::Tensor>> pieces;
  pieces.reserve(batch.size());
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const auto& t = batch[i];
    TORCH_CHECK(t.defined(), "stagewise::scatter: tensor ", i, " of the batch is undefined");
    TORCH_CHECK(t.dim() > 0, "stagewise::scatter: tensor ", i,
                " of the batch is a scalar; micro-batches split dimension 0, so each input needs "
                "a batch dimension (unsqueeze(0) it)");
    TORCH_CHECK(t.size(0) == batch[0].size(0), "stagewise::scatter: tensor ", i, " has ",
                t.size(0), " rows but tensor 0 has ", batch[0].size(0),
                "; every tensor of a batch must share dimension 0");
    pieces.push_back(t.chunk(chunks, 0));
  }
  std::vector<Batch> out;
  const std::size_t n = pieces.front().size();
  out.reserve(n);
  for (std::size_t c = 0; c < n; ++c) {
    if (batch.atomic()) {
      out.emplace_back(pieces.front()[c]);
    } else {
      std::vector<torch::Tensor> row;
      row.reserve(pieces.size());
      for (auto& p : pieces) row.push_back(p[c]);
      out.emplace_back(std::move(row));
    }
  }
  return out;
}

/// Concatenates micro-batches back into one batch along dimension 0 (the inverse of scatter).
inline Batch gather(const std::vector<Batch>& batches) {
  TORCH_CHECK(!batches.empty(), "stagewise::gather: no micro-batches to gather");
  const Batch& first = batches.front();
  for (std::size_t c = 1; c < batches.size(); ++c) {
    TORCH_CHECK(batches[c].atomic() == first.atomic() && batches[c].size() == first.size(),
                "stagewise::gather: micro-batch ", c, " has a different structure (",
                batches[c].atomic() ? "atomic" : "tuple of " + std::to_string(batches[c].size()),
                ") than micro-batch 0 (",
                first.atomic() ? "atomic" : "tuple of " + std::to_string(first.size()), ")");
  }
  std::vector<torch::Tensor> out;
  out.reserve(first.size());
  std::vector<torch::Tensor> column(batches.size());
  for (std::size_t i = 0; i < first.size(); ++i) {
    for (std::size_t c = 0; c < batches.size(); ++c) column[c] = batches[c][i];
    out.push_back(torch::cat(column, 0));
  }
  if (first.atomic()) return Batch(std::move(out.front()));
  return Batch(std::move(out));
}

}  // namespace stagewise
