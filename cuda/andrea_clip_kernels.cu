// k_grad_norm_partial, k_grad_norm_final and k_grad_scale: the GPU pipeline of
// the clip. The chunk table reaches the kernels by value as a kernel parameter
// (no host-to-device copy per call); partial sums go to fixed slots, reduced in
// a fixed order (no atomics), so results are bit-identical run to run. Squares
// are accumulated in float64: no overflow or underflow for any f32/bf16/f16.
//
// On sm_90 and later the final and scale kernels are launched with programmatic
// dependent launch: each is scheduled while the kernel before it still runs and
// waits on the device (griddepcontrol.wait) for that kernel's results, so the
// launch latency of the two small stages hides behind the norm pass. The scale
// grid is sized to what the GPU holds at once and strides over the chunks, so a
// step that does not clip costs one wave of blocks that read a flag and exit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "andrea_clip_device.cuh"
#include "andrea_clip_kernels.h"

namespace clipjax {
namespace {

using namespace device;  // NOLINT: the kernels' own building blocks

template <int kCap>
__global__ void __launch_bounds__(kThreads)
    k_grad_norm_partial(const __grid_constant__ ChunkTable<kCap> table, double* partials,
                        int64_t* leaf_range) {
  __shared__ double shared[kThreads / 32];
  AllowNextKernel();
  const int64_t chunk = table.chunk_base + blockIdx.x;
  const TableEntry& e = table.entry[FindEntry(table, chunk)];
  const int64_t local = chunk - e.chunk_begin;
  const int64_t begin = local * kChunkElems;
  const int64_t remaining = e.num_elements - begin;
  const int64_t count = remaining < kChunkElems ? (remaining > 0 ? remaining : 0) : kChunkElems;
  double acc;
  if (e.dtype == kF32) acc = EntrySumSquares<kF32>(e, begin, count);
  else if (e.dtype == kBF16) acc = EntrySumSquares<kBF16>(e, begin, count);
  else if (e.dtype == kF16) acc = EntrySumSquares<kF16>(e, begin, count);
  else if (e.dtype == kF32AsBF16) acc = EntrySumSquares<kF32AsBF16>(e, begin, count);
  else acc = EntrySumSquares<kF32AsF16>(e, begin, count);
  acc = BlockSum(acc, shared);
  if (threadIdx.x == 0) {
    partials[chunk] = acc;
    if (local == 0) {
      leaf_range[2 * e.leaf] = e.chunk_begin;
      leaf_range[2 * e.leaf + 1] = NumChunks(e.num_elements);
    }
  }
}

// One block. Its time is latency, not bandwidth, so each warp has the ranges and
// first partials of kLeavesInFlight leaves in flight at once, and the per-leaf
// sums stay in shared memory while they fit. The summation order is fixed (lane
// strides, then a shuffle tree; leaves in thread strides, then a block tree).
constexpr int kLeavesInFlight = 8;
constexpr int kSharedLeaves = 4096;  // leaf sums kept in shared memory (32 KB) up to this

__global__ void __launch_bounds__(kFinalThreads)
    k_grad_norm_final(int64_t num_leaves, const double* __restrict__ partials,
                      const int64_t* __restrict__ leaf_range, double* __restrict__ leaf_sumsq,
                      LeafScale* __restrict__ leaf_scale, Multipliers* __restrict__ multipliers,
                      const float* __restrict__ max_norm_ptr, float* __restrict__ norms,
                      int32_t* __restrict__ flags, bool per_tensor, bool zero_nonfinite) {
  __shared__ double shared[kFinalThreads / 32];
  __shared__ double total_shared;
  __shared__ double sums_shared[kSharedLeaves];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kWarps = kFinalThreads / 32;
  AllowNextKernel();
  WaitForPriorKernel();  // the partial sums
  double* sums = num_leaves <= kSharedLeaves ? sums_shared : leaf_sumsq;
  // Per-leaf sums: one warp per leaf, lanes stride over the leaf's chunks.
  for (int64_t base = warp; base < num_leaves; base += kWarps * kLeavesInFlight) {
    // Chunk indices and counts in 32 bits (the table of one call holds far fewer than
    // 2^31 chunks), so that eight leaves in flight fit the 64 registers per thread that a
    // 1024-thread block allows, on every architecture.
    int32_t first[kLeavesInFlight], count[kLeavesInFlight];
    double s[kLeavesInFlight];
#pragma unroll
    for (int j = 0; j < kLeavesInFlight; ++j) {
      const int64_t i = base + j * kWarps;
      first[j] = i < num_leaves ? static_cast<int32_t>(leaf_range[2 * i]) : 0;
      count[j] = i < num_leaves ? static_cast<int32_t>(leaf_range[2 * i + 1]) : 0;
    }
#pragma unroll
    for (int j = 0; j < kLeavesInFlight; ++j) s[j] = lane < count[j] ? partials[first[j] + lane] : 0.0;
#pragma unroll
    for (int j = 0; j < kLeavesInFlight; ++j) {
      for (int32_t c = lane + 32; c < count[j]; c += 32) s[j] += partials[first[j] + c];
      for (int off = 16; off > 0; off >>= 1) s[j] += __shfl_down_sync(0xffffffffu, s[j], off);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kLeavesInFlight; ++j) {
        const int64_t i = base + j * kWarps;
        if (i < num_leaves) {
          sums[i] = s[j];
          norms[1 + i] = NormFromSumsq(s[j]);
        }
      }
    }
  }
  __syncthreads();
  double t = 0.0;
  for (int64_t i = threadIdx.x; i < num_leaves; i += kFinalThreads) t += sums[i];
  t = BlockSum(t, shared);
  if (threadIdx.x == 0) total_shared = t;
  __syncthreads();
  const double total = total_shared;
  const float max_norm = *max_norm_ptr;
  const bool all_finite = IsFiniteDouble(total);
  const LeafScale global = DecideScale(total, max_norm, zero_nonfinite, all_finite);
  int clipped = 0;
  for (int64_t i = threadIdx.x; i < num_leaves; i += kFinalThreads) {
    const LeafScale s =
        per_tensor ? DecideScale(sums[i], max_norm, zero_nonfinite, all_finite) : global;
    leaf_scale[i] = s;
    multipliers[i] = MultipliersOf(s);
    clipped |= s.action != kKeep;
  }
  clipped = __syncthreads_or(clipped);
  if (threadIdx.x == 0) {
    norms[0] = NormFromSumsq(total);
    flags[0] = clipped;
    flags[1] = all_finite ? 0 : 1;
  }
}

// Blocks stride over the chunks (grid = what the GPU holds at once). `any_action`
// (the clip's "clipped" flag; null in the scale-only call) lets a step that does
// not clip skip the table lookups altogether.
template <int kCap>
__global__ void __launch_bounds__(kThreads)
    k_grad_scale(const __grid_constant__ ChunkTable<kCap> table, int64_t num_chunks,
                 const LeafScale* leaf_scale, const int32_t* any_action) {
  WaitForPriorKernel();  // the decisions
  if (any_action != nullptr && *any_action == 0) return;  // an unclipped step writes nothing
  for (int64_t b = blockIdx.x; b < num_chunks; b += gridDim.x) {
    const int64_t chunk = table.chunk_base + b;
    const TableEntry& e = table.entry[FindEntry(table, chunk)];
    const LeafScale s = leaf_scale[e.leaf];
    if (s.action == kKeep) continue;
    const int64_t begin = (chunk - e.chunk_begin) * kChunkElems;
    const int64_t remaining = e.num_elements - begin;
    if (remaining <= 0) continue;
    const int64_t count = remaining < kChunkElems ? remaining : kChunkElems;
    char* base = static_cast<char*>(e.data) + begin * ElemBytes(e.dtype);
    if (s.action == kMultiplyWide) {
      if (e.dtype == kF32) ChunkScaleWide<kF32>(base, count, s.factor);
      else if (e.dtype == kBF16) ChunkScaleWide<kBF16>(base, count, s.factor);
      else ChunkScaleWide<kF16>(base, count, s.factor);
      continue;
    }
    const float factor = static_cast<float>(s.factor);
    const bool zero = s.action == kZeroFill;
    if (e.dtype == kF32) ChunkScale<kF32>(base, count, factor, zero);
    else if (e.dtype == kBF16) ChunkScale<kBF16>(base, count, factor, zero);
    else ChunkScale<kF16>(base, count, factor, zero);
  }
}

// The scale-only call: the per-leaf table k_grad_scale reads, from a decision made
// elsewhere (scale * 2**shift; this code is built without flush-to-zero).
__global__ void k_scale_table(int64_t num_leaves, const float* factors, const int32_t* actions,
                              LeafScale* leaf_scale) {
  AllowNextKernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_leaves) return;
  leaf_scale[i] = ScaleFromDecision(factors[2 * i], factors[2 * i + 1], actions[i]);
}

// What the launches need to know of the device that runs them, looked up once per
// device: programmatic dependent launch needs compute capability 9.0 (and is off
// when CLIPJAX_PDL=0); the scale grid is as many blocks as the GPU holds at once.
struct DeviceInfo {
  bool pdl;
  int64_t scale_blocks;
};

constexpr int kMaxDevices = 64;

template <int kCap>
int64_t ResidentScaleBlocks(int num_sms) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_grad_scale<kCap>, kThreads, 0) !=
          cudaSuccess ||
      per_sm < 1) {
    per_sm = 1;
  }
  return static_cast<int64_t>(per_sm) * num_sms;
}

cudaError_t GetDeviceInfo(DeviceInfo* info) {
  static std::atomic<int64_t> cache[kMaxDevices];  // 0: unknown; else 1 + blocks, negated without PDL
  // The current device (XLA makes the stream's device current before it calls a
  // handler); cudaStreamGetDevice is not allowed while the stream is being captured.
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const int64_t known = device < kMaxDevices ? cache[device].load(std::memory_order_relaxed) : 0;
  if (known != 0) {
    info->pdl = known > 0;
    info->scale_blocks = (known > 0 ? known : -known) - 1;
    return cudaSuccess;
  }
  int major = 0, num_sms = 0;
  err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const char* env = std::getenv("CLIPJAX_PDL");
  info->pdl = major >= 9 && !(env != nullptr && std::strcmp(env, "0") == 0);
  // The smallest of the three table sizes' occupancies (they differ only in the table).
  int64_t blocks = ResidentScaleBlocks<32>(num_sms);
  const int64_t b256 = ResidentScaleBlocks<256>(num_sms);
  const int64_t b1000 = ResidentScaleBlocks<kMaxLeavesPerLaunch>(num_sms);
  if (b256 < blocks) blocks = b256;
  if (b1000 < blocks) blocks = b1000;
  info->scale_blocks = blocks;
  if (device < kMaxDevices) {
    cache[device].store(info->pdl ? 1 + blocks : -(1 + blocks), std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// Launches `kernel` on `stream`; with `pdl`, it may start before the kernel ahead
// of it in the stream has finished (it must call WaitForPriorKernel first).
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), int64_t blocks, int threads, bool pdl,
                   cudaStream_t stream, Args... args) {
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// One stage over a call's leaves: the partial sums (into `partials`/`leaf_range`) or
// the scale (from `leaf_scale`; `any_action`, the clip's "clipped" flag or null).
struct Stage {
  const LeafDesc* leaves;
  int64_t num_leaves;
  bool partial;
  double* partials;
  int64_t* leaf_range;
  const LeafScale* leaf_scale;
  const int32_t* any_action;
};

template <int kCap>
cudaError_t LaunchGroup(const Stage& stage, int64_t first, int64_t count, const DeviceInfo& info,
                        bool pdl, cudaStream_t stream) {
  ChunkTable<kCap> table;
  table.chunk_base = stage.leaves[first].chunk_begin;
  table.num_entries = static_cast<int32_t>(count);
  table.unused = 0;
  int64_t end_chunk = table.chunk_base;
  for (int64_t j = 0; j < count; ++j) {
    const LeafDesc& leaf = stage.leaves[first + j];
    TableEntry& e = table.entry[j];
    e.data = stage.partial ? const_cast<void*>(leaf.in) : leaf.out;
    e.num_elements = leaf.num_elements;
    e.chunk_begin = leaf.chunk_begin;
    e.leaf = static_cast<int32_t>(first + j);
    e.dtype = leaf.dtype;
    e.width = leaf.width;
    e.row_stride = leaf.row_stride;
    end_chunk = leaf.chunk_begin + NumChunks(leaf.num_elements);
  }
  const int64_t chunks = end_chunk - table.chunk_base;
  if (stage.partial) {
    return Launch(k_grad_norm_partial<kCap>, chunks, kThreads, false, stream, table,
                  stage.partials, stage.leaf_range);
  }
  const int64_t blocks = chunks < info.scale_blocks ? chunks : info.scale_blocks;
  return Launch(k_grad_scale<kCap>, blocks, kThreads, pdl, stream, table, chunks,
                stage.leaf_scale, stage.any_action);
}

// Launches one stage over all leaves, in groups that fit a parameter table;
// a small table is used when few leaves remain, so launches stay cheap. With
// `pdl`, the stage's launches may start early (the scale stage: each waits on
// the device for the kernel before it).
cudaError_t LaunchStage(const Stage& stage, const DeviceInfo& info, bool pdl,
                        cudaStream_t stream) {
  for (int64_t first = 0; first < stage.num_leaves; first += kMaxLeavesPerLaunch) {
    const int64_t left = stage.num_leaves - first;
    const int64_t count = left < kMaxLeavesPerLaunch ? left : kMaxLeavesPerLaunch;
    cudaError_t err;
    if (count <= 32) err = LaunchGroup<32>(stage, first, count, info, pdl, stream);
    else if (count <= 256) err = LaunchGroup<256>(stage, first, count, info, pdl, stream);
    else err = LaunchGroup<kMaxLeavesPerLaunch>(stage, first, count, info, pdl, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Results that XLA did not alias to their operands start as copies of them; then the
// scale stage. After a copy the scale kernel starts the ordinary way (the early start
// is for a kernel that follows a kernel).
cudaError_t CopyAndScale(const Stage& stage, const DeviceInfo& info, cudaStream_t stream) {
  bool copied = false;
  for (int64_t i = 0; i < stage.num_leaves; ++i) {
    const LeafDesc& leaf = stage.leaves[i];
    if (leaf.out != leaf.in && leaf.num_elements > 0) {
      const cudaError_t err =
          cudaMemcpyAsync(leaf.out, leaf.in, leaf.num_elements * ElemBytes(leaf.dtype),
                          cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return err;
      copied = true;
    }
  }
  return LaunchStage(stage, info, info.pdl && !copied, stream);
}

}  // namespace

cudaError_t LaunchAndreaClip(const ClipCall& call, cudaStream_t stream) {
  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return err;
  uint8_t* ws = call.workspace;
  auto* leaf_scale = reinterpret_cast<LeafScale*>(ws + call.layout.leaf_scale);
  Stage partial = {call.leaves, call.num_leaves, true,
                   reinterpret_cast<double*>(ws + call.layout.partials),
                   reinterpret_cast<int64_t*>(ws + call.layout.leaf_range), nullptr, nullptr};
  err = LaunchStage(partial, info, false, stream);
  if (err != cudaSuccess) return err;
  err = Launch(k_grad_norm_final, 1, kFinalThreads, info.pdl, stream, call.num_leaves,
               reinterpret_cast<const double*>(ws + call.layout.partials),
               reinterpret_cast<const int64_t*>(ws + call.layout.leaf_range),
               reinterpret_cast<double*>(ws + call.layout.leaf_sumsq), leaf_scale,
               call.multipliers, call.max_norm, call.norms, call.flags, call.per_tensor,
               call.zero_nonfinite);
  if (err != cudaSuccess || !call.scale_leaves) return err;
  Stage scale = {call.leaves, call.num_leaves, false, nullptr, nullptr, leaf_scale, call.flags};
  return CopyAndScale(scale, info, stream);
}

cudaError_t LaunchAndreaScale(const ScaleCall& call, cudaStream_t stream) {
  if (call.num_leaves == 0) return cudaSuccess;
  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return err;
  constexpr int kTableThreads = 256;
  const int64_t blocks = (call.num_leaves + kTableThreads - 1) / kTableThreads;
  err = Launch(k_scale_table, blocks, kTableThreads, false, stream, call.num_leaves,
               call.factors, call.actions, call.table);
  if (err != cudaSuccess) return err;
  Stage scale = {call.leaves, call.num_leaves, false, nullptr, nullptr, call.table, nullptr};
  return CopyAndScale(scale, info, stream);
}

cudaError_t KernelImageFor(int device, int* binary_version, int* ptx_version) {
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    cudaGetLastError();  // leave no error behind for a later launch to report
    return err;
  }
  cudaFuncAttributes attributes;
  err = cudaFuncGetAttributes(&attributes, k_grad_norm_final);
  cudaSetDevice(previous);
  cudaGetLastError();
  if (err == cudaSuccess) {
    *binary_version = attributes.binaryVersion;
    *ptx_version = attributes.ptxVersion;
  }
  return err;
}

}  // namespace clipjax
