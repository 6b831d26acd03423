// The CUDA kernels of the two custom calls and the host functions that enqueue
// them. A launcher takes a decoded call (andrea_clip_calls.h): leaf pointers and
// sizes on the host, every other pointer in device memory. It never synchronises
// and never allocates; it returns the first launch error.
#ifndef CLIPJAX_ANDREA_CLIP_KERNELS_H_
#define CLIPJAX_ANDREA_CLIP_KERNELS_H_

#include <cuda_runtime.h>

#include "andrea_clip_calls.h"

namespace clipjax {

// Enqueues on `stream`:
//   k_grad_norm_partial  one block per chunk of every leaf -> partials
//                        (one launch per group of up to kMaxLeavesPerLaunch)
//   k_grad_norm_final    one block: per-leaf and global sums, norms, decisions (also as
//                        the fused multiply's Multipliers)
//   k_grad_scale         as many blocks as the GPU holds, striding over the chunks;
//                        when nothing clips, each reads one flag and exits
// On sm_90+ the last two use programmatic dependent launch: they are scheduled
// while the kernel before them runs and wait on the device for its results
// (CLIPJAX_PDL=0 turns this off; the results are the same bits either way).
cudaError_t LaunchAndreaClip(const ClipCall& call, cudaStream_t stream);

// The scale-only call (`clipjax_andrea_scale`, decoded by DecodeScaleCall):
//   k_scale_table        one thread per leaf: factors and actions -> LeafScale table
//   k_grad_scale         as above (without the flag: it looks up every chunk's leaf)
cudaError_t LaunchAndreaScale(const ScaleCall& call, cudaStream_t stream);

// Whether this module holds code that `device` can run, as the CUDA runtime decides it
// for one of the kernels, without launching anything: cudaErrorNoKernelImageForDevice
// when no compiled architecture fits, cudaErrorInsufficientDriver for a driver older than
// the runtime linked in. On success, the architecture of the code it picked (e.g. 90) and
// of the PTX it was made from. The calling thread's current device is kept.
cudaError_t KernelImageFor(int device, int* binary_version, int* ptx_version);

// Leaves described in one kernel parameter table (passed by value; CUDA 12.1+
// allows kernel parameters up to 32 KB: 800 entries of 40 bytes).
constexpr int kMaxLeavesPerLaunch = 800;

}  // namespace clipjax

#endif  // CLIPJAX_ANDREA_CLIP_KERNELS_H_
