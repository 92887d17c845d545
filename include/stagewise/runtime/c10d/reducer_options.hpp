#pragma once

#include <cstdint>
#include <string>

namespace stagewise::runtime {

/// How a sharded GradientReducer (`ReducerOptions::shard`) brings each bucket's sum to the
/// owners of its parameters, from what every c10d backend has (Gloo has no reduce-scatter in
/// LibTorch 1.13 or 2.6). The bucket is laid out owner by owner; d is the group's size and N the
/// bucket's bytes.
/// - `reduce` (default): one summing reduce per owner, to it, over its part of the bucket, in
///   place: no buffer beyond the bucket's copy; Gloo's reduce is a ring reduce-scatter and a
///   gather to the root, so each rank sends about (d-1)/d x N plus its ring chunk to the root.
/// - `all_to_all`: each rank sends each owner its part (an all-to-all of uneven pieces) and the
///   owner adds the d pieces itself, in rank order: each rank sends (d-1)/d x N, the least, but
///   receives into a buffer of its part times d.
/// - `all_reduce`: the unsharded all-reduce, after which the others drop their parts: 2(d-1)/d x N
///   sent per rank, but the very sums the unsharded reducer makes (bit for bit on any d).
/// On 2 ranks every way gives the unsharded sums bit for bit (a + b == b + a).
enum class ReduceScatter { reduce, all_to_all, all_reduce };

/// How a GradientReducer groups and reduces gradients.
struct ReducerOptions {
  /// Bytes of gradients per bucket (one all-reduce each); 25 MiB by default, as PyTorch's DDP.
  std::int64_t bucket_bytes = 25 * 1024 * 1024;
  /// Whether a parameter that got a gradient on some ranks but not others in a backward is
  /// reduced with zeros from those (what one process on the whole batch computes), rather than
  /// being an error. A parameter no rank used keeps its gradient untouched either way.
  bool unused_parameters = false;
  /// Opens every error ("stagewise::distributed::DataParallel").
  std::string who = "stagewise::runtime::GradientReducer";
  /// Whether backward drives the reduction (hooks on the parameters' gradient accumulators, from
  /// `mark`ed outputs); false: the caller does, with `launch()` once the gradients are final and
  /// `complete()` (a pipeline stage after its last backward of a step).
  bool from_backward = true;
  /// The option that allows partly used parameters, as the error for them names it.
  std::string unused_fix = "DataParallelOptions().unused_parameters(true)";
  /// Shards the parameters over the group (ZeRO): each is owned by one rank
  /// (`optim::shard_owners`, whole tensors balanced by size); a reduction leaves the averaged
  /// gradient only on its owner and frees the others' copies bucket by bucket, and
  /// `GradientReducer::gather_parameters` sends each owner's updated parameters to every rank.
  bool shard = false;
  /// How a sharded reducer sums each bucket to the owners (see `ReduceScatter`).
  ReduceScatter reduce_scatter = ReduceScatter::reduce;
  /// Sharded and driven by launch()/complete(): reduce-scatter every backward pass between
  /// `begin_pass()` and `end_pass()` (each micro-batch's, in a pipe) bucket by bucket as its
  /// gradients arrive, each owner adding the averages up over the passes, so no rank holds more
  /// than a bucket or two of gradients beyond its own shard (ZeRO-2 with gradient accumulation;
  /// a pass's worth of communication each time). launch() then only counts the ranks that used
  /// each parameter, and complete() writes the owners' sums.
  bool reduce_each_pass = false;
};

}  // namespace stagewise::runtime
