// The CUDA handler of the `clipjax_andrea_clip` custom call.
#ifndef CLIPJAX_ANDREA_CLIP_CUDA_H_
#define CLIPJAX_ANDREA_CLIP_CUDA_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(AndreaClipCuda);

#endif  // CLIPJAX_ANDREA_CLIP_CUDA_H_
