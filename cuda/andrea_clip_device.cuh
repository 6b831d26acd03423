// Device code shared by the clip's kernels (andrea_clip_kernels.cu): the chunk
// table that reaches them as a kernel parameter, the early-launch handshake, block
// sums, and the loops that sum the squares of one chunk and scale it, per leaf type.
#ifndef CLIPJAX_ANDREA_CLIP_DEVICE_CUH_
#define CLIPJAX_ANDREA_CLIP_DEVICE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "andrea_clip_calls.h"

namespace clipjax {
namespace device {

constexpr int kThreads = 256;       // partial and scale kernels
constexpr int kFinalThreads = 1024;  // final kernel (one block)
constexpr int kUnroll = 4;           // 16-byte loads in flight per thread

struct TableEntry {
  void* data;  // leaf input (partial) or output (scale)
  int64_t num_elements;
  int64_t chunk_begin;
  int32_t leaf;  // index of the leaf in the whole call
  int32_t dtype;
  int32_t width;  // as LeafDesc: 0 for a contiguous leaf, else its rows' width and stride
  int32_t row_stride;
};

template <int kCap>
struct ChunkTable {
  int64_t chunk_base;  // first chunk of this launch; block b owns chunk_base + b
  int32_t num_entries;
  int32_t unused;
  TableEntry entry[kCap];
};

// The entry whose chunk range holds global chunk `chunk` (binary search over
// the parameter table; the index is uniform across the block).
template <int kCap>
__device__ __forceinline__ int FindEntry(const ChunkTable<kCap>& t, int64_t chunk) {
  int lo = 0, hi = t.num_entries - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.entry[mid].chunk_begin <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Waits until the kernel this one depends on has finished and its writes are
// visible. Returns at once for a kernel launched the ordinary way.
__device__ __forceinline__ void WaitForPriorKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel, when launched with programmatic dependent launch, be
// scheduled now; it still waits in WaitForPriorKernel for this one to finish.
__device__ __forceinline__ void AllowNextKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ double BlockSum(double v, double* shared) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  v = 0.0;
  if (warp == 0) {
    v = lane < warps ? shared[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;  // valid in thread 0
}

__device__ __forceinline__ void AddSquare(float x, double& acc) {
  const double d = x;
  acc = fma(d, d, acc);
}

// The value a float32 element of a leaf of type kDtype stands for: itself (kF32), or
// rounded to bfloat16 (kF32AsBF16) or float16 (kF32AsF16), to nearest even as XLA's
// convert rounds it, and widened back: the value the narrowed leaf holds.
template <int kDtype>
__device__ __forceinline__ float Rounded(float x) {
  if (kDtype == kF32AsBF16) return __bfloat162float(__float2bfloat16_rn(x));
  if (kDtype == kF32AsF16) return __half2float(__float2half_rn(x));
  return x;
}

// Whether a leaf type stores float32 elements.
constexpr bool StoresF32(int kDtype) { return ElemBytes(kDtype) == 4; }

// Squares of one 16-byte vector of leaf elements.
template <int kDtype>
__device__ __forceinline__ void AddSquares(const uint4& r, double& a, double& b) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (StoresF32(kDtype)) {
      AddSquare(Rounded<kDtype>(__uint_as_float(w[k])), (k & 1) ? b : a);
    } else if (kDtype == kBF16) {
      AddSquare(__uint_as_float(w[k] << 16), a);
      AddSquare(__uint_as_float(w[k] & 0xffff0000u), b);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
      AddSquare(f.x, a);
      AddSquare(f.y, b);
    }
  }
}

template <int kDtype>
__device__ __forceinline__ float LoadScalar(const void* p, int64_t i) {
  if (StoresF32(kDtype)) return Rounded<kDtype>(static_cast<const float*>(p)[i]);
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (kDtype == kBF16) return __uint_as_float(static_cast<uint32_t>(h) << 16);
  return __half2float(__ushort_as_half(h));
}

template <int kDtype>
__device__ __forceinline__ void StoreScalar(void* p, int64_t i, float v) {
  if (kDtype == kF32) {
    static_cast<float*>(p)[i] = v;
  } else if (kDtype == kBF16) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  }
}

// Sum of squares of `count` elements at `p` (this block's chunk).
template <int kDtype>
__device__ double ChunkSumSquares(const void* p, int64_t count) {
  constexpr int kVec = 16 / ElemBytes(kDtype);
  double a = 0.0, b = 0.0;
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    const uint4* pv = static_cast<const uint4*>(p);
    const int64_t nvec = count / kVec;
    int64_t v = threadIdx.x;
    for (; v + (kUnroll - 1) * kThreads < nvec; v += kUnroll * kThreads) {
      uint4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = __ldg(pv + v + u * kThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) AddSquares<kDtype>(r[u], a, b);
    }
    for (; v < nvec; v += kThreads) AddSquares<kDtype>(__ldg(pv + v), a, b);
    done = nvec * kVec;
  }
  for (int64_t k = done + threadIdx.x; k < count; k += kThreads) {
    AddSquare(LoadScalar<kDtype>(p, k), a);
  }
  return a + b;
}

// Sum of squares of the leaf elements [begin, begin + count) of a leaf that is a block of
// columns: rows of `width` elements, `row_stride` apart (this block's chunk). Where the
// rows are whole 16-byte vectors, each thread keeps the (row, column) of its next vector
// and steps it by the block's stride (no division per load); otherwise element by element.
template <int kDtype>
__device__ double ColumnsSumSquares(const void* p, int64_t begin, int64_t count, int32_t width,
                                    int32_t row_stride) {
  constexpr int kVec = 16 / ElemBytes(kDtype);
  double a = 0.0, b = 0.0;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && width % kVec == 0 &&
      row_stride % kVec == 0 && begin % kVec == 0) {
    const uint4* pv = static_cast<const uint4*>(p);
    const int32_t row_vecs = width / kVec;
    const int64_t stride_vecs = row_stride / kVec;
    const int32_t step_rows = kThreads / row_vecs, step_cols = kThreads % row_vecs;
    const int64_t nvec = count / kVec;  // whole: count is whole rows or a whole chunk
    const int64_t first = begin / kVec + threadIdx.x;
    int64_t row = first / row_vecs;
    int32_t col = static_cast<int32_t>(first % row_vecs);
    auto next = [&]() {
      const uint4* at = pv + row * stride_vecs + col;
      col += step_cols;
      row += step_rows;
      if (col >= row_vecs) {
        col -= row_vecs;
        ++row;
      }
      return __ldg(at);
    };
    int64_t v = threadIdx.x;
    for (; v + (kUnroll - 1) * kThreads < nvec; v += kUnroll * kThreads) {
      uint4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = next();
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) AddSquares<kDtype>(r[u], a, b);
    }
    for (; v < nvec; v += kThreads) AddSquares<kDtype>(next(), a, b);
    return a + b;
  }
  for (int64_t k = begin + threadIdx.x; k < begin + count; k += kThreads) {
    AddSquare(LoadScalar<kDtype>(p, k / width * row_stride + k % width), a);
  }
  return a + b;
}

// Sum of squares of this block's chunk of table entry `e`: `count` elements from its
// element `begin`.
template <int kDtype>
__device__ __forceinline__ double EntrySumSquares(const TableEntry& e, int64_t begin,
                                                  int64_t count) {
  if (e.width != 0) return ColumnsSumSquares<kDtype>(e.data, begin, count, e.width, e.row_stride);
  return ChunkSumSquares<kDtype>(static_cast<const char*>(e.data) + begin * ElemBytes(kDtype),
                                 count);
}

template <int kDtype>
__device__ __forceinline__ uint32_t ScalePair(uint32_t w, float s) {
  if (kDtype == kF32) return __float_as_uint(__uint_as_float(w) * s);
  if (kDtype == kBF16) {
    const __nv_bfloat16 lo = __float2bfloat16_rn(__uint_as_float(w << 16) * s);
    const __nv_bfloat16 hi = __float2bfloat16_rn(__uint_as_float(w & 0xffff0000u) * s);
    return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
  }
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
  const __half2 h = __floats2half2_rn(f.x * s, f.y * s);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Multiplies (or zero-fills) `count` elements at `p` in place.
template <int kDtype>
__device__ void ChunkScale(void* p, int64_t count, float s, bool zero) {
  constexpr int kVec = 16 / ElemBytes(kDtype);
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    uint4* pv = static_cast<uint4*>(p);
    const int64_t nvec = count / kVec;
    if (zero) {
      for (int64_t v = threadIdx.x; v < nvec; v += kThreads) pv[v] = make_uint4(0, 0, 0, 0);
    } else {
      int64_t v = threadIdx.x;
      for (; v + (kUnroll - 1) * kThreads < nvec; v += kUnroll * kThreads) {
        uint4 r[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) r[u] = pv[v + u * kThreads];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          r[u].x = ScalePair<kDtype>(r[u].x, s);
          r[u].y = ScalePair<kDtype>(r[u].y, s);
          r[u].z = ScalePair<kDtype>(r[u].z, s);
          r[u].w = ScalePair<kDtype>(r[u].w, s);
          pv[v + u * kThreads] = r[u];
        }
      }
      for (; v < nvec; v += kThreads) {
        uint4 r = pv[v];
        r.x = ScalePair<kDtype>(r.x, s);
        r.y = ScalePair<kDtype>(r.y, s);
        r.z = ScalePair<kDtype>(r.z, s);
        r.w = ScalePair<kDtype>(r.w, s);
        pv[v] = r;
      }
    }
    done = nvec * kVec;
  }
  for (int64_t k = done + threadIdx.x; k < count; k += kThreads) {
    StoreScalar<kDtype>(p, k, zero ? 0.0f : LoadScalar<kDtype>(p, k) * s);
  }
}

// Multiplies `count` elements at `p` by a factor below float32's normal range, in
// float64 with one rounding to float32. Rare (a norm 2**126 times max_norm), so plain.
template <int kDtype>
__device__ void ChunkScaleWide(void* p, int64_t count, double factor) {
  for (int64_t k = threadIdx.x; k < count; k += kThreads) {
    StoreScalar<kDtype>(p, k, static_cast<float>(static_cast<double>(LoadScalar<kDtype>(p, k)) * factor));
  }
}

}  // namespace device
}  // namespace clipjax

#endif  // CLIPJAX_ANDREA_CLIP_DEVICE_CUH_
