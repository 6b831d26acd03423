// The CUDA handlers of the `clipjax_andrea_clip` and `clipjax_andrea_scale` custom calls.
#ifndef CLIPJAX_ANDREA_CLIP_CUDA_H_
#define CLIPJAX_ANDREA_CLIP_CUDA_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(AndreaClipCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AndreaScaleCuda);

#endif  // CLIPJAX_ANDREA_CLIP_CUDA_H_
