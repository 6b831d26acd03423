// Python module `clipjax._clipjax_cuda`: hands the CUDA handlers to JAX, with the
// sizes the Python wrapper needs.
#include <nanobind/nanobind.h>

#include "andrea_clip_cuda.h"
#include "bindings_layout.h"

namespace nb = nanobind;

NB_MODULE(_clipjax_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["clipjax_andrea_clip"] = nb::capsule(reinterpret_cast<void*>(AndreaClipCuda));
    d["clipjax_andrea_scale"] = nb::capsule(reinterpret_cast<void*>(AndreaScaleCuda));
    return d;
  });
  clipjax::DefineLayout(m);
}
