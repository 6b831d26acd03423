// Definitions shared by the CPU handler, the CUDA kernels and the Python
// wrapper: the chunking of leaves, the workspace layout and the clip decision.
// Everything here compiles both as host C++ and as CUDA device code.
#ifndef CLIPJAX_ANDREA_CLIP_COMMON_H_
#define CLIPJAX_ANDREA_CLIP_COMMON_H_

#include <cmath>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define CLIPJAX_HD __host__ __device__ __forceinline__
#else
#define CLIPJAX_HD inline
#endif

namespace clipjax {

// Every leaf is cut into chunks of this many elements; one partial sum of
// squares per chunk. A zero-size leaf still owns one (empty) chunk, so every
// leaf has at least one partial and one block that records its chunk range.
constexpr int64_t kChunkElems = 32768;

// Leaf element types understood by the custom call.
enum LeafDtype : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Values of the `mode` and `on_nonfinite` attributes.
enum ClipMode : int64_t { kModeGlobal = 0, kModePerTensor = 1 };
enum NonFinitePolicy : int64_t { kPropagate = 0, kZero = 1 };

// What the scale stage does to one leaf.
enum LeafAction : int32_t { kKeep = 0, kMultiply = 1, kZeroFill = 2 };

struct LeafScale {
  float scale;
  int32_t action;  // a LeafAction
};

// One leaf of a call, as the three stages see it.
struct LeafDesc {
  const void* in;
  void* out;  // nullptr when the call only computes the norm
  int64_t num_elements;
  int64_t chunk_begin;  // index of the leaf's first chunk among all chunks
  int32_t dtype;        // a LeafDtype
};

CLIPJAX_HD int64_t NumChunks(int64_t num_elements) {
  return num_elements <= 0 ? 1 : (num_elements + kChunkElems - 1) / kChunkElems;
}

// Workspace (an extra result of the custom call, so that nothing is allocated
// while it runs), in this order, each part 16-byte aligned:
//   double    partials[num_chunks]      sum of squares of each chunk
//   int64_t   leaf_range[2 * num_leaves] first chunk and chunk count per leaf
//   double    leaf_sumsq[num_leaves]    sum of squares of each leaf
//   LeafScale leaf_scale[num_leaves]    what the scale stage does per leaf
CLIPJAX_HD int64_t AlignUp16(int64_t n) { return (n + 15) & ~int64_t{15}; }

struct WorkspaceLayout {
  int64_t partials, leaf_range, leaf_sumsq, leaf_scale, total_bytes;
};

CLIPJAX_HD WorkspaceLayout MakeWorkspaceLayout(int64_t num_chunks, int64_t num_leaves) {
  WorkspaceLayout w;
  w.partials = 0;
  w.leaf_range = AlignUp16(w.partials + 8 * num_chunks);
  w.leaf_sumsq = AlignUp16(w.leaf_range + 16 * num_leaves);
  w.leaf_scale = AlignUp16(w.leaf_sumsq + 8 * num_leaves);
  w.total_bytes = AlignUp16(w.leaf_scale + 8 * num_leaves);
  if (w.total_bytes < 16) w.total_bytes = 16;
  return w;
}

// The clip decision, identical on every platform and in the pure-JAX path:
//   norm    = float32(sqrt(sum of squares))   (sum accumulated in float64)
//   clipped = !(norm <= max_norm)             (a NaN norm counts as clipped)
//   scale   = max_norm / norm                 (float32 division)
// With on_nonfinite = zero, a NaN/inf sum of squares zero-fills instead.
// A finite sum whose root exceeds the float32 range gets its scale from the
// float64 root, so huge finite gradients are still scaled, not zeroed.
CLIPJAX_HD float NormFromSumsq(double sumsq) { return static_cast<float>(sqrt(sumsq)); }

CLIPJAX_HD bool IsFiniteDouble(double x) { return x - x == 0.0; }

CLIPJAX_HD LeafScale DecideScale(double sumsq, float max_norm, bool zero_nonfinite,
                                 bool all_finite) {
  LeafScale s;
  if (zero_nonfinite && !all_finite) {
    s.scale = 0.0f;
    s.action = kZeroFill;
    return s;
  }
  const float norm = NormFromSumsq(sumsq);
  if (norm <= max_norm) {
    s.scale = 1.0f;
    s.action = kKeep;
    return s;
  }
  if (IsFiniteDouble(sumsq) && !(norm - norm == 0.0f)) {
    s.scale = static_cast<float>(static_cast<double>(max_norm) / sqrt(sumsq));
  } else {
    s.scale = max_norm / norm;
  }
  s.action = kMultiply;
  return s;
}

// Workspace of the scale-only call (`clipjax_andrea_scale`): LeafScale[num_leaves].
CLIPJAX_HD int64_t ScaleWorkspaceBytes(int64_t num_leaves) {
  const int64_t bytes = AlignUp16(8 * num_leaves);
  return bytes < 16 ? 16 : bytes;
}

// One decoded custom call: what the three stages need, on either platform.
struct ClipCall {
  const LeafDesc* leaves = nullptr;
  int64_t num_leaves = 0;
  int64_t num_chunks = 0;
  bool scale_leaves = false;  // false: compute the norms only
  bool per_tensor = false;
  bool zero_nonfinite = false;
  const float* max_norm = nullptr;  // device memory on CUDA, host memory on CPU
  float* norms = nullptr;           // [1 + num_leaves]: global norm, then per leaf
  int32_t* flags = nullptr;         // [2]: clipped, nonfinite
  uint8_t* workspace = nullptr;
  WorkspaceLayout layout{};
  // The scale-only call: the decision was made elsewhere (by the sharded clip, after
  // its all-reduce). Per leaf: factors[2i] * factors[2i + 1] and a LeafAction.
  const float* factors = nullptr;
  const int32_t* actions = nullptr;
};

}  // namespace clipjax

#endif  // CLIPJAX_ANDREA_CLIP_COMMON_H_
