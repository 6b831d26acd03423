// The two decoded custom calls, as the CPU handler and the CUDA launchers take
// them: the leaves with their chunk offsets, and where each result goes. Leaf
// pointers and sizes are host values; on CUDA every other pointer is device memory.
#ifndef CLIPJAX_ANDREA_CLIP_CALLS_H_
#define CLIPJAX_ANDREA_CLIP_CALLS_H_

#include <cstdint>

#include "andrea_clip_workspace.h"

namespace clipjax {

// One leaf of a call. Its elements are contiguous at `in`, or (a leaf the norms read
// as a block of columns of a wider matrix) rows of `width` elements whose starts are
// `row_stride` elements apart; element k is then at (k / width) * row_stride + k % width.
struct LeafDesc {
  const void* in;
  void* out;  // nullptr when the call only computes the norm
  int64_t num_elements;
  int64_t chunk_begin;  // index of the leaf's first chunk among all chunks
  int32_t dtype;        // a LeafDtype
  int32_t width;        // 0: contiguous
  int32_t row_stride;
};

// `clipjax_andrea_clip`: norms, decision and (unless `scale_leaves` is false) the scale.
struct ClipCall {
  const LeafDesc* leaves = nullptr;
  int64_t num_leaves = 0;
  int64_t num_chunks = 0;
  bool scale_leaves = false;
  bool per_tensor = false;
  bool zero_nonfinite = false;
  const float* max_norm = nullptr;
  float* norms = nullptr;    // [1 + num_leaves]: global norm, then per leaf
  int32_t* flags = nullptr;  // [2]: clipped, nonfinite
  Multipliers* multipliers = nullptr;  // [num_leaves]: each leaf's decision, for the fused multiply
  uint8_t* workspace = nullptr;
  ClipWorkspace layout{};
};

// `clipjax_andrea_scale`: the scale stage alone, for a decision made elsewhere (the
// sharded clip's, after its all-reduce). Per leaf i: factors[2i] is the scale,
// factors[2i + 1] the power-of-two shift, actions[i] a LeafAction (keep, multiply
// or zero-fill); `table` is the workspace, the LeafScale per leaf.
struct ScaleCall {
  const LeafDesc* leaves = nullptr;
  int64_t num_leaves = 0;
  int64_t num_chunks = 0;
  const float* factors = nullptr;
  const int32_t* actions = nullptr;
  LeafScale* table = nullptr;
};

}  // namespace clipjax

#endif  // CLIPJAX_ANDREA_CLIP_CALLS_H_
