// Python module `clipjax._clipjax_cpu`: hands the CPU handler to JAX and
// exposes the chunking constants the Python wrapper needs to size results.
#include <nanobind/nanobind.h>

#include "andrea_clip_common.h"
#include "andrea_clip_cpu.h"

namespace nb = nanobind;

NB_MODULE(_clipjax_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["clipjax_andrea_clip"] = nb::capsule(reinterpret_cast<void*>(AndreaClipCpu));
    d["clipjax_andrea_scale"] = nb::capsule(reinterpret_cast<void*>(AndreaScaleCpu));
    return d;
  });
  m.attr("CHUNK_ELEMS") = clipjax::kChunkElems;
  m.def("workspace_bytes", [](int64_t num_chunks, int64_t num_leaves) {
    return clipjax::MakeWorkspaceLayout(num_chunks, num_leaves).total_bytes;
  });
  m.def("scale_workspace_bytes",
        [](int64_t num_leaves) { return clipjax::ScaleWorkspaceBytes(num_leaves); });
}
