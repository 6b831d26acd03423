// Decoding the custom calls' FFI buffers into ClipCall / ScaleCall (host side,
// shared by the CPU and CUDA handlers): the variadic leaf buffers become a flat
// list of LeafDesc with their chunk offsets, and every buffer is checked.
#ifndef CLIPJAX_ANDREA_CLIP_DECODE_H_
#define CLIPJAX_ANDREA_CLIP_DECODE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "andrea_clip_calls.h"
#include "xla/ffi/api/ffi.h"

namespace clipjax {

namespace ffi = xla::ffi;

inline bool ToLeafDtype(ffi::DataType t, int32_t* out) {
  switch (t) {
    case ffi::DataType::F32: *out = kF32; return true;
    case ffi::DataType::BF16: *out = kBF16; return true;
    case ffi::DataType::F16: *out = kF16; return true;
    default: return false;
  }
}

// The values of the clip call's `read_as` attribute, one per operand: how the norms
// read it (clipjax/_ffi.py, READ_AS).
enum ReadAs : int64_t { kAsStored = 0, kRoundedToBF16 = 1, kRoundedToF16 = 2 };

// Leaf i's elements within its operand, as the clip call's `columns` attribute gives them
// (two values per operand: first column, width): the whole operand where the width is 0,
// else that block of columns of a two-dimensional operand (row-major, as the call
// constrains it), which the norms read in place. Columns never apply to a leaf the call
// scales.
inline ffi::Error DecodeColumns(int64_t i, const ffi::AnyBuffer& operand, int64_t first,
                                int64_t width, bool scale_leaves, LeafDesc* d) {
  d->num_elements = static_cast<int64_t>(operand.element_count());
  d->width = 0;
  d->row_stride = 0;
  if (width == 0 && first == 0) return ffi::Error::Success();
  const std::string leaf = "clipjax: columns of leaf " + std::to_string(i);
  const auto dims = operand.dimensions();
  if (scale_leaves) {
    return ffi::Error::InvalidArgument(leaf +
                                       " are given, but the call scales its leaves in place");
  }
  if (dims.size() != 2) {
    return ffi::Error::InvalidArgument(leaf + " need a two-dimensional operand; it has " +
                                       std::to_string(dims.size()) + " dimensions");
  }
  const int64_t cols = dims[1];
  if (width <= 0 || first < 0 || first > cols - width) {
    return ffi::Error::InvalidArgument(leaf + " (first " + std::to_string(first) + ", width " +
                                       std::to_string(width) + ") are not within its operand's " +
                                       std::to_string(cols) + " columns");
  }
  if (cols > INT32_MAX) {
    return ffi::Error::InvalidArgument(leaf + " are read from an operand of " +
                                       std::to_string(cols) + " columns, more than 2^31 - 1");
  }
  d->in = static_cast<const char*>(d->in) + first * ElemBytes(d->dtype);
  d->num_elements = dims[0] * width;
  if (width < cols && dims[0] > 1) {
    d->width = static_cast<int32_t>(width);
    d->row_stride = static_cast<int32_t>(cols);
  }
  return ffi::Error::Success();
}

// The leaves (the remaining operands) and, when `scale_leaves`, their results
// (results 0 ... n - 1), with each leaf's chunk offset. `read_as` is empty (every
// operand as stored) or holds one ReadAs per operand: a float32 operand read rounded
// to bfloat16 or float16 becomes a kF32AsBF16 or kF32AsF16 leaf. `columns` is empty
// (every operand whole) or holds two values per operand (DecodeColumns).
inline ffi::Error DecodeLeaves(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                               bool scale_leaves, ffi::Span<const int64_t> read_as,
                               ffi::Span<const int64_t> columns,
                               std::vector<LeafDesc>* leaves, int64_t* num_chunks) {
  const int64_t n = static_cast<int64_t>(args.size());
  if (read_as.size() != 0 && static_cast<int64_t>(read_as.size()) != n) {
    return ffi::Error::InvalidArgument("clipjax: read_as has " + std::to_string(read_as.size()) +
                                       " values for " + std::to_string(n) + " leaves");
  }
  if (columns.size() != 0 && static_cast<int64_t>(columns.size()) != 2 * n) {
    return ffi::Error::InvalidArgument("clipjax: columns has " + std::to_string(columns.size()) +
                                       " values for " + std::to_string(n) +
                                       " leaves (two per leaf: first column, width)");
  }
  leaves->clear();
  leaves->reserve(n);
  int64_t chunk = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto leaf = args.get<ffi::AnyBuffer>(i);
    if (!leaf.has_value()) return leaf.error();
    LeafDesc d;
    if (!ToLeafDtype(leaf->element_type(), &d.dtype)) {
      return ffi::Error::InvalidArgument("clipjax: leaf " + std::to_string(i) +
                                         " has an unsupported element type (supported: "
                                         "float32, bfloat16, float16)");
    }
    const int64_t how = read_as.size() == 0 ? kAsStored : read_as[i];
    if (how != kAsStored) {
      if (how != kRoundedToBF16 && how != kRoundedToF16) {
        return ffi::Error::InvalidArgument("clipjax: read_as of leaf " + std::to_string(i) +
                                           " must be 0 (as stored), 1 (rounded to bfloat16) "
                                           "or 2 (rounded to float16), got " +
                                           std::to_string(how));
      }
      if (d.dtype != kF32 || scale_leaves) {
        return ffi::Error::InvalidArgument(
            "clipjax: leaf " + std::to_string(i) + " is read rounded, which takes a float32 "
            "operand that the call does not scale");
      }
      d.dtype = how == kRoundedToBF16 ? kF32AsBF16 : kF32AsF16;
    }
    d.in = leaf->untyped_data();
    d.chunk_begin = chunk;
    d.out = nullptr;
    ffi::Error status = DecodeColumns(i, *leaf, columns.size() ? columns[2 * i] : 0,
                                      columns.size() ? columns[2 * i + 1] : 0, scale_leaves, &d);
    if (status.failure()) return status;
    if (scale_leaves) {
      auto out = rets.get<ffi::AnyBuffer>(i);
      if (!out.has_value()) return out.error();
      if ((*out)->element_type() != leaf->element_type() ||
          static_cast<int64_t>((*out)->element_count()) != d.num_elements) {
        return ffi::Error::InvalidArgument("clipjax: result " + std::to_string(i) +
                                           " does not match the type and size of leaf " +
                                           std::to_string(i));
      }
      d.out = (*out)->untyped_data();
    }
    chunk += NumChunks(d.num_elements);
    leaves->push_back(d);
  }
  *num_chunks = chunk;
  return ffi::Error::Success();
}

// `clipjax_andrea_clip`. Operands: max_norm (f32 scalar), leaf_0 ... leaf_{n-1}, each
// read as `read_as` and `columns` say (DecodeLeaves). Results: [leaf_0 ... leaf_{n-1}] (aliased to the operands; absent when the call
// only computes the norm), norms f32[n + 1] (global norm, then one per leaf),
// flags s32[2] (clipped, nonfinite), multipliers f32[n, 4] (a Multipliers per leaf),
// workspace u8[>= MakeClipWorkspace(...).total_bytes].
inline ffi::Error DecodeClipCall(const ffi::AnyBuffer& max_norm, const ffi::RemainingArgs& args,
                             const ffi::RemainingRets& rets, int64_t mode,
                             int64_t on_nonfinite, ffi::Span<const int64_t> read_as,
                             ffi::Span<const int64_t> columns,
                             std::vector<LeafDesc>* leaves, ClipCall* call) {
  if (mode != kModeGlobal && mode != kModePerTensor) {
    return ffi::Error::InvalidArgument("clipjax: mode must be 0 (global) or 1 (per_tensor), got " +
                                       std::to_string(mode));
  }
  if (on_nonfinite != kPropagate && on_nonfinite != kZero) {
    return ffi::Error::InvalidArgument(
        "clipjax: on_nonfinite must be 0 (propagate) or 1 (zero), got " +
        std::to_string(on_nonfinite));
  }
  if (max_norm.element_type() != ffi::DataType::F32 || max_norm.element_count() != 1) {
    return ffi::Error::InvalidArgument("clipjax: max_norm must be a float32 scalar");
  }
  const int64_t n = static_cast<int64_t>(args.size());
  const int64_t num_rets = static_cast<int64_t>(rets.size());
  if (num_rets != n + 4 && num_rets != 4) {
    return ffi::Error::InvalidArgument("clipjax: expected " + std::to_string(n + 4) + " or 4 results for " +
                                       std::to_string(n) + " leaves, got " + std::to_string(num_rets));
  }
  call->scale_leaves = num_rets == n + 4;
  call->per_tensor = mode == kModePerTensor;
  call->zero_nonfinite = on_nonfinite == kZero;
  call->max_norm = static_cast<const float*>(max_norm.untyped_data());

  int64_t chunk = 0;
  ffi::Error status = DecodeLeaves(args, rets, call->scale_leaves, read_as, columns, leaves, &chunk);
  if (status.failure()) return status;
  call->leaves = leaves->data();
  call->num_leaves = n;
  call->num_chunks = chunk;
  call->layout = MakeClipWorkspace(chunk, n);

  const int64_t first = call->scale_leaves ? n : 0;
  auto norms = rets.get<ffi::AnyBuffer>(first);
  auto flags = rets.get<ffi::AnyBuffer>(first + 1);
  auto multipliers = rets.get<ffi::AnyBuffer>(first + 2);
  auto workspace = rets.get<ffi::AnyBuffer>(first + 3);
  if (!norms.has_value()) return norms.error();
  if (!flags.has_value()) return flags.error();
  if (!multipliers.has_value()) return multipliers.error();
  if (!workspace.has_value()) return workspace.error();
  if ((*norms)->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>((*norms)->element_count()) != n + 1) {
    return ffi::Error::InvalidArgument("clipjax: the norms result must be float32[" +
                                       std::to_string(n + 1) + "]");
  }
  if ((*flags)->element_type() != ffi::DataType::S32 || (*flags)->element_count() != 2) {
    return ffi::Error::InvalidArgument("clipjax: the flags result must be int32[2]");
  }
  if ((*multipliers)->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>((*multipliers)->element_count()) != 4 * n) {
    return ffi::Error::InvalidArgument("clipjax: the multipliers result must be float32[" +
                                       std::to_string(n) + ", 4]");
  }
  if ((*workspace)->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>((*workspace)->element_count()) < call->layout.total_bytes) {
    return ffi::Error::InvalidArgument("clipjax: the workspace result must be uint8[>= " +
                                       std::to_string(call->layout.total_bytes) + "]");
  }
  call->norms = static_cast<float*>((*norms)->untyped_data());
  call->flags = static_cast<int32_t*>((*flags)->untyped_data());
  call->multipliers = static_cast<Multipliers*>((*multipliers)->untyped_data());
  call->workspace = static_cast<uint8_t*>((*workspace)->untyped_data());
  return ffi::Error::Success();
}

// `clipjax_andrea_scale`. Operands: factors f32[2n] (leaf i's scale, then its shift),
// actions s32[n], leaf_0 ... leaf_{n-1}. Results: leaf_0 ... leaf_{n-1} (aliased to the
// operands), then workspace u8[>= ScaleWorkspaceBytes(n)] for the per-leaf LeafScale table.
// The call constrains no layout: the leaves may come in any (the kernel is elementwise),
// and every other buffer has one dimension.
inline ffi::Error DecodeScaleCall(const ffi::AnyBuffer& factors, const ffi::AnyBuffer& actions,
                                  const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                  std::vector<LeafDesc>* leaves, ScaleCall* call) {
  const int64_t n = static_cast<int64_t>(args.size());
  if (factors.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(factors.element_count()) != 2 * n) {
    return ffi::Error::InvalidArgument("clipjax: the factors operand must be float32[" +
                                       std::to_string(2 * n) + "] for " + std::to_string(n) +
                                       " leaves");
  }
  if (actions.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(actions.element_count()) != n) {
    return ffi::Error::InvalidArgument("clipjax: the actions operand must be int32[" +
                                       std::to_string(n) + "]");
  }
  if (static_cast<int64_t>(rets.size()) != n + 1) {
    return ffi::Error::InvalidArgument("clipjax: expected " + std::to_string(n + 1) +
                                       " results for " + std::to_string(n) + " leaves, got " +
                                       std::to_string(rets.size()));
  }
  int64_t chunk = 0;
  ffi::Error status = DecodeLeaves(args, rets, true, {}, {}, leaves, &chunk);
  if (status.failure()) return status;
  auto workspace = rets.get<ffi::AnyBuffer>(n);
  if (!workspace.has_value()) return workspace.error();
  if ((*workspace)->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>((*workspace)->element_count()) < ScaleWorkspaceBytes(n)) {
    return ffi::Error::InvalidArgument("clipjax: the workspace result must be uint8[>= " +
                                       std::to_string(ScaleWorkspaceBytes(n)) + "]");
  }
  call->leaves = leaves->data();
  call->num_leaves = n;
  call->num_chunks = chunk;
  call->table = static_cast<LeafScale*>((*workspace)->untyped_data());
  call->factors = static_cast<const float*>(factors.untyped_data());
  call->actions = static_cast<const int32_t*>(actions.untyped_data());
  return ffi::Error::Success();
}

}  // namespace clipjax

#endif  // CLIPJAX_ANDREA_CLIP_DECODE_H_
