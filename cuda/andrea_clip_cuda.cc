// The CUDA handler: decodes the call and enqueues the three kernels on XLA's
// stream. Command-buffer compatible: it allocates nothing and never syncs.
#include "andrea_clip_cuda.h"

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "andrea_clip_kernels.h"
#include "andrea_clip_plan.h"

namespace clipjax {
namespace {

ffi::Error AndreaClipCudaImpl(cudaStream_t stream, ffi::AnyBuffer max_norm,
                              ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t mode,
                              int64_t on_nonfinite) {
  thread_local std::vector<LeafDesc> leaves;
  ClipCall call;
  ffi::Error status = DecodeCall(max_norm, args, rets, mode, on_nonfinite, &leaves, &call);
  if (status.failure()) return status;
  const cudaError_t err = LaunchAndreaClip(call, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("clipjax: CUDA launch failed: ") +
                                cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace clipjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(AndreaClipCuda, clipjax::AndreaClipCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("on_nonfinite"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
