// The CPU handlers of the `clipjax_andrea_clip` and `clipjax_andrea_scale` custom calls.
#ifndef CLIPJAX_ANDREA_CLIP_CPU_H_
#define CLIPJAX_ANDREA_CLIP_CPU_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(AndreaClipCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AndreaScaleCpu);

#endif  // CLIPJAX_ANDREA_CLIP_CPU_H_
