// The CPU handler of the `clipjax_andrea_clip` custom call.
#ifndef CLIPJAX_ANDREA_CLIP_CPU_H_
#define CLIPJAX_ANDREA_CLIP_CPU_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(AndreaClipCpu);

#endif  // CLIPJAX_ANDREA_CLIP_CPU_H_
