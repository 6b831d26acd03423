// The clip's arithmetic, shared by the CPU handler, the CUDA kernels and (in
// meaning) the pure-JAX path: what a norm is and what the clip does with it.
// Everything here compiles both as host C++ and as CUDA device code.
#ifndef CLIPJAX_ANDREA_CLIP_MATH_H_
#define CLIPJAX_ANDREA_CLIP_MATH_H_

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define CLIPJAX_HD __host__ __device__ __forceinline__
#else
#define CLIPJAX_HD inline
#endif

namespace clipjax {

// Leaf element types understood by the custom calls. The last two are float32
// operands that the norm kernels read rounded to bfloat16 or float16 first, as the
// leaf the jit narrowed from them holds its values (the clip call's `read_as`); they
// are never scaled.
enum LeafDtype : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF32AsBF16 = 3, kF32AsF16 = 4 };

// Bytes an element of a LeafDtype takes in memory.
CLIPJAX_HD constexpr int ElemBytes(int32_t dtype) { return dtype == kBF16 || dtype == kF16 ? 2 : 4; }

// Values of the `mode` and `on_nonfinite` attributes.
enum ClipMode : int64_t { kModeGlobal = 0, kModePerTensor = 1 };
enum NonFinitePolicy : int64_t { kPropagate = 0, kZero = 1 };

// What the scale stage does to one leaf. kMultiply multiplies by the factor as a
// float32 (a normal one); kMultiplyWide multiplies in float64 and rounds once, for a
// factor below float32's normal range, which a float32 multiply would flush or lose.
enum LeafAction : int32_t { kKeep = 0, kMultiply = 1, kZeroFill = 2, kMultiplyWide = 3 };

struct LeafScale {
  double factor;
  int32_t action;  // a LeafAction
  int32_t unused;
};

CLIPJAX_HD float NormFromSumsq(double sumsq) { return static_cast<float>(sqrt(sumsq)); }

CLIPJAX_HD bool IsFiniteDouble(double x) { return x - x == 0.0; }

// x rounded to float32's 24 significant bits, at any exponent (below float32's range
// too, where a float32 would flush it).
CLIPJAX_HD double RoundToFloatMantissa(double x) {
  int e;
  const double m = frexp(x, &e);
  return ldexp(static_cast<double>(static_cast<float>(m)), e);
}

// A multiply by `factor` (> 0): as float32 where it is a normal float32, else wide.
CLIPJAX_HD LeafScale Multiply(double factor) {
  LeafScale s;
  s.factor = factor;
  s.action = factor >= static_cast<double>(FLT_MIN) ? kMultiply : kMultiplyWide;
  s.unused = 0;
  return s;
}

// The clip decision, identical on every platform and in the pure-JAX path:
//   norm    = float32(sqrt(sum of squares))   (sum accumulated in float64)
//   clipped = !(norm <= max_norm)             (a NaN norm counts as clipped)
//   factor  = max_norm / norm                 (float32 division)
// With on_nonfinite = zero, a NaN/inf sum of squares zero-fills instead. Where the
// float32 quotient is not a normal float32 (a norm above the float32 range, or a
// factor below 2**-126) and the sum is finite, the factor is max_norm / sqrt(sum)
// in float64 rounded to float32's 24 significant bits (max_norm / norm as a float32
// division would round it, were the exponent unbounded; sqrt(sum) for a norm above the
// float32 range), applied in float64 and rounded once: huge finite gradients are
// scaled, never zeroed, and x * factor equals (x * mantissa) * 2**exponent in float32
// wherever that is a normal float32, which is how the fused and pure-JAX paths apply it.
CLIPJAX_HD LeafScale DecideScale(double sumsq, float max_norm, bool zero_nonfinite,
                                 bool all_finite) {
  LeafScale s;
  s.unused = 0;
  if (zero_nonfinite && !all_finite) {
    s.factor = 0.0;
    s.action = kZeroFill;
    return s;
  }
  const float norm = NormFromSumsq(sumsq);
  if (norm <= max_norm) {
    s.factor = 1.0;
    s.action = kKeep;
    return s;
  }
  const float quotient = max_norm / norm;
  if (quotient >= FLT_MIN || !IsFiniteDouble(sumsq)) {
    s.factor = quotient;
    s.action = kMultiply;
    return s;
  }
  const double root = norm <= FLT_MAX ? static_cast<double>(norm) : sqrt(sumsq);
  return Multiply(RoundToFloatMantissa(static_cast<double>(max_norm) / root));
}

// A decision as the fused multiply applies it (clipjax/_jax_impl.py, `scale_leaf`):
// zeros where `zero` is 1, else ((x * scale) * low) * high in float32, where low * high
// is the factor's power of two below float32's normal range, split into two powers of
// two that are floats themselves (0 below 2**-126), as `_jax_impl.multipliers` splits
// the pure-JAX decision. A kept leaf gets 1, 1, 1: x * 1 is x.
struct Multipliers {
  float scale, low, high, zero;
};

CLIPJAX_HD float Pow2Float(int k) { return k < -126 ? 0.0f : ldexpf(1.0f, k); }

CLIPJAX_HD Multipliers MultipliersOf(const LeafScale& s) {
  Multipliers m = {1.0f, 1.0f, 1.0f, 0.0f};
  if (s.action == kZeroFill) {
    m.scale = 0.0f;
    m.zero = 1.0f;
  } else if (s.action == kMultiply) {  // a normal float32 factor, 0 or NaN
    m.scale = static_cast<float>(s.factor);
  } else if (s.action == kMultiplyWide) {  // factor = mantissa * 2**e, e < -125
    int e;
    m.scale = static_cast<float>(frexp(s.factor, &e));  // exact: 24 significant bits
    const int half = e >= 0 ? e / 2 : -((1 - e) / 2);    // floor(e / 2)
    m.low = Pow2Float(half);
    m.high = Pow2Float(e - half);
  }
  return m;
}

// The scale-only call's entry for one leaf: `action` (keep, multiply or zero-fill)
// with the factor scale * 2**shift, as the pure-JAX decision gives it
// (clipjax/_jax_impl.py: `decide`).
CLIPJAX_HD LeafScale ScaleFromDecision(float scale, float shift, int32_t action) {
  if (action != kMultiply) {
    LeafScale s;
    s.factor = action == kKeep ? 1.0 : 0.0;
    s.action = action;
    s.unused = 0;
    return s;
  }
  return Multiply(ldexp(static_cast<double>(scale), static_cast<int>(shift)));
}

}  // namespace clipjax

#endif  // CLIPJAX_ANDREA_CLIP_MATH_H_
