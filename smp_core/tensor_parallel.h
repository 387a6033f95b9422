// Tensor parallelism's decisions and group communication: which slice of a weight a tp
// rank holds, and the autograd-aware collectives a distributed module (smp.nn) runs at
// its boundaries. Python builds the modules; what is cut, where, and what crosses the
// tp group is decided and moved here. See docs/tensor_parallel.md and Note [Entering
// and leaving a distributed module] in tensor_parallel.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"

namespace smp::tp {

// How a weight is cut across a tp group.
enum class Cut {
  kColumn,        // output rows of a [out, in] weight (and its bias): dim 0
  kRow,           // input columns of a [out, in] weight: dim 1; the bias stays whole
  kEmbeddingDim,  // columns of a [num_embeddings, embedding_dim] table: dim 1
};

// The part of a tensor of full extent `full` along `dim` that one tp rank holds.
struct Slice {
  int64_t dim = 0;
  int64_t start = 0;
  int64_t length = 0;
  int64_t full = 0;
};

// Parses "column", "row" or "embedding_dim"; throws ConfigError naming the allowed.
Cut parse_cut(const std::string& name);

// The slice of a weight of `full_shape` cut `cut` that rank `rank` of a tp group of
// `size` holds: the rank-th of `size` equal contiguous parts. Throws ConfigError when
// the cut extent is not divisible by size, naming `what` (e.g. "DistributedLinear
// in_features"), the value and tensor_parallel_degree.
Slice slice_of(const std::string& what, Cut cut, const std::vector<int64_t>& full_shape,
               int size, int rank);

// Throws ConfigError unless `value` (the setting `what`) is divisible by `size`.
void check_divisible(const std::string& what, int64_t value, int size);

// Rank `rank`'s part of `full`: the slice along its dim (a view).
at::Tensor take(const at::Tensor& full, const Slice& s);

// A tp group as the collectives see it. An empty pg (tp = 1, or smp not initialized)
// makes every collective the identity.
struct Group {
  ProcessGroupPtr pg;
  int size = 1;
  int rank = 0;
  bool prescaled_batch = false;  // tp ranks hold the same batch
  double timeout_s = 300.0;
};

// The runtime's tp group (Group{} before smp.init or with tp = 1).
Group current_group();

// Into a distributed module: without prescaled_batch the group's batches gathered
// along dim 0 in tp rank order (backward: the summed gradient's rows of this rank);
// with it the identity (backward: the gradient summed over the group). With `check`,
// first verifies that every rank brings the same shape (apart from dim 0's extent,
// which must also agree), so a mismatch is an error on every rank, not a hang.
at::Tensor enter(const at::Tensor& x, const Group& g, bool check, const std::string& what);

// Out of a distributed module: a partial result (each rank's summand) summed over the
// group; without prescaled_batch only this rank's rows of the sum are kept (a
// reduce-scatter along dim 0; backward: the gradients' rows gathered); with it the
// whole sum (backward: the identity).
at::Tensor leave(const at::Tensor& y, const Group& g, const std::string& what);

// A dropout of `x`, this rank's slice `s` (along s.dim, of a tensor whose full shape
// is `full_shape`) of a tensor the reference module drops whole: the mask of the full
// tensor is drawn (the draws the reference makes) and its slice applied. The slice is
// the heads a rank computes, or its own rows of the tp group's batch after leave().
at::Tensor dropout(const at::Tensor& x, double p, bool training,
                   const std::vector<int64_t>& full_shape, const Slice& s);

}  // namespace smp::tp
