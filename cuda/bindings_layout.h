// What both native modules tell the Python wrapper: the FFI API they were built against,
// and, so that either one alone can size a call's results, the chunk size and the
// workspace bytes of each call.
#ifndef CLIPJAX_BINDINGS_LAYOUT_H_
#define CLIPJAX_BINDINGS_LAYOUT_H_

#include <nanobind/nanobind.h>

#include "andrea_clip_workspace.h"
#include "xla/ffi/api/c_api.h"

namespace clipjax {

inline void DefineLayout(nanobind::module_& m) {
  // The XLA FFI API the handlers were built against: XLA refuses a newer one than its own.
  m.attr("FFI_API") = nanobind::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("CHUNK_ELEMS") = kChunkElems;
  m.def("workspace_bytes", [](int64_t num_chunks, int64_t num_leaves) {
    return MakeClipWorkspace(num_chunks, num_leaves).total_bytes;
  });
  m.def("scale_workspace_bytes", [](int64_t num_leaves) { return ScaleWorkspaceBytes(num_leaves); });
}

}  // namespace clipjax

#endif  // CLIPJAX_BINDINGS_LAYOUT_H_
