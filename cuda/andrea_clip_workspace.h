// How the custom calls cut leaves into chunks and lay out their workspace (an
// extra result of each call, so that nothing is allocated while it runs).
// Compiles as host C++ and as CUDA; the Python wrapper reads the sizes through
// the CPU module.
#ifndef CLIPJAX_ANDREA_CLIP_WORKSPACE_H_
#define CLIPJAX_ANDREA_CLIP_WORKSPACE_H_

#include <cstdint>

#include "andrea_clip_math.h"

namespace clipjax {

// Every leaf is cut into chunks of this many elements; one partial sum of
// squares per chunk. A zero-size leaf still owns one (empty) chunk, so every
// leaf has at least one partial and one block that records its chunk range.
constexpr int64_t kChunkElems = 32768;

CLIPJAX_HD int64_t NumChunks(int64_t num_elements) {
  return num_elements <= 0 ? 1 : (num_elements + kChunkElems - 1) / kChunkElems;
}

CLIPJAX_HD int64_t AlignUp16(int64_t n) { return (n + 15) & ~int64_t{15}; }

// The clip call's workspace, in this order, each part 16-byte aligned:
//   double    partials[num_chunks]      sum of squares of each chunk
//   int64_t   leaf_range[2 * num_leaves] first chunk and chunk count per leaf
//   double    leaf_sumsq[num_leaves]    sum of squares of each leaf
//   LeafScale leaf_scale[num_leaves]    what the scale stage does per leaf
struct ClipWorkspace {
  int64_t partials, leaf_range, leaf_sumsq, leaf_scale, total_bytes;
};

CLIPJAX_HD ClipWorkspace MakeClipWorkspace(int64_t num_chunks, int64_t num_leaves) {
  ClipWorkspace w;
  w.partials = 0;
  w.leaf_range = AlignUp16(w.partials + 8 * num_chunks);
  w.leaf_sumsq = AlignUp16(w.leaf_range + 16 * num_leaves);
  w.leaf_scale = AlignUp16(w.leaf_sumsq + 8 * num_leaves);
  w.total_bytes = AlignUp16(w.leaf_scale + sizeof(LeafScale) * num_leaves);
  if (w.total_bytes < 16) w.total_bytes = 16;
  return w;
}

// The scale-only call's workspace: LeafScale[num_leaves].
CLIPJAX_HD int64_t ScaleWorkspaceBytes(int64_t num_leaves) {
  const int64_t bytes = AlignUp16(sizeof(LeafScale) * num_leaves);
  return bytes < 16 ? 16 : bytes;
}

}  // namespace clipjax

#endif  // CLIPJAX_ANDREA_CLIP_WORKSPACE_H_
