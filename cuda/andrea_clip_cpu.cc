// CPU twin of the CUDA pipeline: the same three stages over the same chunks,
// so every test of the custom-call plumbing (variadic leaves, aliasing, the
// max_norm operand, mixed dtypes, the workspace) runs without a GPU.
#include "andrea_clip_cpu.h"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "andrea_clip_decode.h"
#include "xla/ffi/api/ffi.h"

namespace clipjax {
namespace {

float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    mag = man ? NAN : INFINITY;
  } else {
    mag = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &mag, 4);
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(a)) return sign | 0x7e00u;
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds to infinity
  if (a < 6.103515625e-05f) {               // subnormal range: multiples of 2^-24
    const float q = std::nearbyint(a * 16777216.0f);  // round half to even
    return sign | static_cast<uint16_t>(q);
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  float q = std::nearbyint(std::ldexp(m, 11));  // 11 significant bits
  if (q == 2048.0f) {
    q = 1024.0f;
    ++e;
  }
  const uint32_t biased = static_cast<uint32_t>(e - 1 + 15);
  return sign | static_cast<uint16_t>((biased << 10) | (static_cast<uint32_t>(q) - 1024u));
}

// Element access per leaf type; the loops below are instantiated per type so
// that the compiler sees plain arrays (and vectorises the scale loop).
struct F32Leaf {
  using Storage = float;
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};
struct BF16Leaf {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return Bf16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToBf16(v); }
};
struct F16Leaf {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return F16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToF16(v); }
};
// Float32 operands that the norms read rounded to the narrowed leaf's type (never scaled).
struct F32AsBF16Leaf {
  using Storage = float;
  static float Load(float v) { return BF16Leaf::Load(BF16Leaf::Store(v)); }
};
struct F32AsF16Leaf {
  using Storage = float;
  static float Load(float v) { return F16Leaf::Load(F16Leaf::Store(v)); }
};

// Sum of squares of a leaf's elements [begin, end) in float64, with eight independent
// accumulators added in a fixed order at the end: deterministic, and not bound by one
// add's latency. A leaf read as a block of columns is summed a row's run at a time.
template <typename Leaf>
double SumSquares(const LeafDesc& leaf, int64_t begin, int64_t end) {
  const auto* x = static_cast<const typename Leaf::Storage*>(leaf.in);
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = begin; k < end;) {
    int64_t at = k, run = end - k;  // the run of elements from k adjacent in memory
    if (leaf.width != 0) {
      const int64_t col = k % leaf.width;
      at = k / leaf.width * leaf.row_stride + col;
      run = std::min(run, leaf.width - col);
    }
    int64_t j = 0;
    for (; j + 8 <= run; j += 8) {
      for (int u = 0; u < 8; ++u) {
        const double v = Leaf::Load(x[at + j + u]);
        acc[u] += v * v;
      }
    }
    for (; j < run; ++j) {
      const double v = Leaf::Load(x[at + j]);
      acc[0] += v * v;
    }
    k += run;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// The leaf scaled in place as `s` says: a float32 multiply, a float64 one rounded
// once (kMultiplyWide), or zeros.
template <typename Leaf>
void ApplyInPlace(void* base, int64_t n, const LeafScale& s) {
  auto* x = static_cast<typename Leaf::Storage*>(base);
  if (s.action == kZeroFill) {
    std::memset(x, 0, n * sizeof(typename Leaf::Storage));
  } else if (s.action == kMultiplyWide) {
    for (int64_t k = 0; k < n; ++k) {
      x[k] = Leaf::Store(static_cast<float>(static_cast<double>(Leaf::Load(x[k])) * s.factor));
    }
  } else {
    const float factor = static_cast<float>(s.factor);
    for (int64_t k = 0; k < n; ++k) x[k] = Leaf::Store(Leaf::Load(x[k]) * factor);
  }
}

void Apply(const LeafDesc& leaf, const LeafScale& s) {
  if (s.action == kKeep || leaf.num_elements == 0) return;
  switch (leaf.dtype) {
    case kF32: ApplyInPlace<F32Leaf>(leaf.out, leaf.num_elements, s); break;
    case kBF16: ApplyInPlace<BF16Leaf>(leaf.out, leaf.num_elements, s); break;
    default: ApplyInPlace<F16Leaf>(leaf.out, leaf.num_elements, s); break;
  }
}

// Stage 3 (k_grad_scale on the GPU), for either call. Results that XLA did not alias to
// their operands start as copies of them; leaves that are kept are not written.
void Scale(const LeafDesc* leaves, int64_t num_leaves, const LeafScale* leaf_scale) {
  for (int64_t i = 0; i < num_leaves; ++i) {
    const LeafDesc& leaf = leaves[i];
    if (leaf.out != leaf.in && leaf.num_elements > 0) {
      std::memcpy(leaf.out, leaf.in, leaf.num_elements * ElemBytes(leaf.dtype));
    }
    Apply(leaf, leaf_scale[i]);
  }
}

double ChunkSumSquares(const LeafDesc& leaf, int64_t begin, int64_t end) {
  switch (leaf.dtype) {
    case kF32: return SumSquares<F32Leaf>(leaf, begin, end);
    case kBF16: return SumSquares<BF16Leaf>(leaf, begin, end);
    case kF16: return SumSquares<F16Leaf>(leaf, begin, end);
    case kF32AsBF16: return SumSquares<F32AsBF16Leaf>(leaf, begin, end);
    default: return SumSquares<F32AsF16Leaf>(leaf, begin, end);
  }
}

// Stage 1 (k_grad_norm_partial on the GPU): one sum of squares per chunk.
void NormPartial(const ClipCall& call, double* partials, int64_t* leaf_range) {
  for (int64_t i = 0; i < call.num_leaves; ++i) {
    const LeafDesc& leaf = call.leaves[i];
    const int64_t chunks = NumChunks(leaf.num_elements);
    leaf_range[2 * i] = leaf.chunk_begin;
    leaf_range[2 * i + 1] = chunks;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = c * kChunkElems;
      const int64_t end = std::min(begin + kChunkElems, leaf.num_elements);
      partials[leaf.chunk_begin + c] = ChunkSumSquares(leaf, begin, end);
    }
  }
}

// Stage 2 (k_grad_norm_final): per-leaf and global sums, norms and decisions (as a
// LeafScale for the scale stage and as Multipliers for the fused multiply).
void NormFinal(const ClipCall& call, const double* partials, const int64_t* leaf_range,
                 double* leaf_sumsq, LeafScale* leaf_scale) {
  const int64_t n = call.num_leaves;
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (int64_t c = 0; c < leaf_range[2 * i + 1]; ++c) s += partials[leaf_range[2 * i] + c];
    leaf_sumsq[i] = s;
    call.norms[1 + i] = NormFromSumsq(s);
    total += s;
  }
  const float max_norm = *call.max_norm;
  const bool all_finite = IsFiniteDouble(total);
  call.norms[0] = NormFromSumsq(total);
  int32_t clipped = 0;
  const LeafScale global = DecideScale(total, max_norm, call.zero_nonfinite, all_finite);
  for (int64_t i = 0; i < n; ++i) {
    leaf_scale[i] = call.per_tensor
                        ? DecideScale(leaf_sumsq[i], max_norm, call.zero_nonfinite, all_finite)
                        : global;
    call.multipliers[i] = MultipliersOf(leaf_scale[i]);
    clipped |= leaf_scale[i].action != kKeep;
  }
  if (n == 0) clipped = global.action != kKeep;
  call.flags[0] = clipped;
  call.flags[1] = all_finite ? 0 : 1;
}

ffi::Error AndreaClipCpuImpl(ffi::AnyBuffer max_norm, ffi::RemainingArgs args,
                             ffi::RemainingRets rets, int64_t mode, int64_t on_nonfinite,
                             ffi::Span<const int64_t> read_as,
                             ffi::Span<const int64_t> columns) {
  thread_local std::vector<LeafDesc> leaves;
  ClipCall call;
  ffi::Error status =
      DecodeClipCall(max_norm, args, rets, mode, on_nonfinite, read_as, columns, &leaves,
                     &call);
  if (status.failure()) return status;
  auto* partials = reinterpret_cast<double*>(call.workspace + call.layout.partials);
  auto* leaf_range = reinterpret_cast<int64_t*>(call.workspace + call.layout.leaf_range);
  auto* leaf_sumsq = reinterpret_cast<double*>(call.workspace + call.layout.leaf_sumsq);
  auto* leaf_scale = reinterpret_cast<LeafScale*>(call.workspace + call.layout.leaf_scale);
  NormPartial(call, partials, leaf_range);
  NormFinal(call, partials, leaf_range, leaf_sumsq, leaf_scale);
  if (call.scale_leaves) Scale(call.leaves, call.num_leaves, leaf_scale);
  return ffi::Error::Success();
}

// The scale-only call: each leaf as its action says, the factor scale * 2**shift.
ffi::Error AndreaScaleCpuImpl(ffi::AnyBuffer factors, ffi::AnyBuffer actions,
                              ffi::RemainingArgs args, ffi::RemainingRets rets) {
  thread_local std::vector<LeafDesc> leaves;
  ScaleCall call;
  ffi::Error status = DecodeScaleCall(factors, actions, args, rets, &leaves, &call);
  if (status.failure()) return status;
  for (int64_t i = 0; i < call.num_leaves; ++i) {
    const int32_t action = call.actions[i];
    if (action != kKeep && action != kMultiply && action != kZeroFill) {
      return ffi::Error::InvalidArgument("clipjax: action " + std::to_string(action) +
                                         " of leaf " + std::to_string(i) +
                                         " is not 0 (keep), 1 (multiply) or 2 (zero-fill)");
    }
    call.table[i] = ScaleFromDecision(call.factors[2 * i], call.factors[2 * i + 1], action);
  }
  Scale(call.leaves, call.num_leaves, call.table);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace clipjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(AndreaClipCpu, clipjax::AndreaClipCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("on_nonfinite")
                                  .Attr<xla::ffi::Span<const int64_t>>("read_as")
                                  .Attr<xla::ffi::Span<const int64_t>>("columns"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AndreaScaleCpu, clipjax::AndreaScaleCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());
