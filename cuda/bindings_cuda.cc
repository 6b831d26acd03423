// Python module `clipjax._clipjax_cuda`: hands the CUDA handlers to JAX, with the
// sizes the Python wrapper needs, what the module was built with, and whether a
// device can run its kernels.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <string>
#include <tuple>

#include "andrea_clip_cuda.h"
#include "andrea_clip_kernels.h"
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
  nb::dict build;
  build["architectures"] = CLIPJAX_CUDA_ARCHITECTURES;  // as CMake was given them
  build["compiler"] = CLIPJAX_CUDA_COMPILER_VERSION;
  build["runtime"] = CUDART_VERSION;  // e.g. 13000 for CUDA 13.0, linked in statically
  m.attr("BUILD") = build;
  // (error name and text, or "" where the device can run the kernels; binary, ptx version)
  m.def("kernel_image", [](int device) {
    int binary = 0, ptx = 0;
    const cudaError_t err = clipjax::KernelImageFor(device, &binary, &ptx);
    std::string error;
    if (err != cudaSuccess) {
      error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    }
    return std::make_tuple(error, binary, ptx);
  });
}
