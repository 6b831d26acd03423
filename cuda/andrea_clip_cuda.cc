// The CUDA handlers: decode a call and enqueue its kernels on XLA's stream.
// Command-buffer compatible: they allocate nothing and never sync.
//   AndreaClipCuda   `clipjax_andrea_clip`: the three kernels
//   AndreaScaleCuda  `clipjax_andrea_scale`: the scale stage alone, from a given decision
#include "andrea_clip_cuda.h"

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "andrea_clip_kernels.h"
#include "andrea_clip_decode.h"

namespace clipjax {
namespace {

ffi::Error LaunchResult(cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("clipjax: CUDA launch failed: ") +
                              cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

ffi::Error AndreaClipCudaImpl(cudaStream_t stream, ffi::AnyBuffer max_norm,
                              ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t mode,
                              int64_t on_nonfinite, ffi::Span<const int64_t> read_as,
                              ffi::Span<const int64_t> columns) {
  thread_local std::vector<LeafDesc> leaves;
  ClipCall call;
  ffi::Error status =
      DecodeClipCall(max_norm, args, rets, mode, on_nonfinite, read_as, columns, &leaves,
                     &call);
  if (status.failure()) return status;
  return LaunchResult(LaunchAndreaClip(call, stream));
}

ffi::Error AndreaScaleCudaImpl(cudaStream_t stream, ffi::AnyBuffer factors,
                               ffi::AnyBuffer actions, ffi::RemainingArgs args,
                               ffi::RemainingRets rets) {
  thread_local std::vector<LeafDesc> leaves;
  ScaleCall call;
  ffi::Error status = DecodeScaleCall(factors, actions, args, rets, &leaves, &call);
  if (status.failure()) return status;
  return LaunchResult(LaunchAndreaScale(call, stream));
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
                                  .Attr<int64_t>("on_nonfinite")
                                  .Attr<xla::ffi::Span<const int64_t>>("read_as")
                                  .Attr<xla::ffi::Span<const int64_t>>("columns"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AndreaScaleCuda, clipjax::AndreaScaleCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
