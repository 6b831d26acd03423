// Python module `clipjax._clipjax_cpu`: hands the CPU handlers to JAX, with the
// sizes the Python wrapper needs.
#include <nanobind/nanobind.h>

#include "andrea_clip_cpu.h"
#include "bindings_layout.h"

namespace nb = nanobind;

NB_MODULE(_clipjax_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["clipjax_andrea_clip"] = nb::capsule(reinterpret_cast<void*>(AndreaClipCpu));
    d["clipjax_andrea_scale"] = nb::capsule(reinterpret_cast<void*>(AndreaScaleCpu));
    return d;
  });
  clipjax::DefineLayout(m);
}
