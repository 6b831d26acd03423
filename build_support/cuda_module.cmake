# The CUDA kernels' library, and the Python module that hands them to XLA.
#
# A build that compiles the kernels describes them in kernels.cmake beside the library
# (the library, its architectures, the compiler's version, the runtime to link), so that
# another build links them without compiling them again, or without that compiler at all
# (CLIPJAX_KERNELS, CLIPJAX_CUDA12_KERNELS in CMakeLists.txt).

# Compiles the kernels with NVCC into the static library TARGET (a macro: CMake enables a
# language in the file's scope only).
macro(clipjax_compile_kernels NVCC TARGET)
  set(CMAKE_CUDA_COMPILER "${NVCC}")
  # The architectures: CMAKE_CUDA_ARCHITECTURES or CUDAARCHS when given (`native`, or a
  # list), else real code for every datacenter and workstation GPU from Ampere on that
  # the compiler knows, and PTX of the oldest, which the driver compiles for any newer GPU
  # (one the compiler does not know, or one without real code here, such as sm_110).
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CLIPJAX_DEFAULT_ARCHITECTURES ON)
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  # The CUDA runtime linked in: the module needs only the NVIDIA driver.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
  if(CLIPJAX_DEFAULT_ARCHITECTURES)
    if(CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.8)
      set(CMAKE_CUDA_ARCHITECTURES 80 86-real 89-real 90-real 100-real 120-real)
    else()
      set(CMAKE_CUDA_ARCHITECTURES 80 86-real 89-real 90-real)
    endif()
  endif()
  message(STATUS "clipjax: compiling the CUDA kernels with ${CMAKE_CUDA_COMPILER} "
                 "(CUDA ${CMAKE_CUDA_COMPILER_VERSION}) for ${CMAKE_CUDA_ARCHITECTURES}")
  # The static runtime, where the compiler links from (CMake's FindCUDAToolkit also wants
  # an unversioned libcudart.so, which NVIDIA's wheels on PyPI do not have).
  find_library(CLIPJAX_CUDART_STATIC cudart_static REQUIRED NO_DEFAULT_PATH
               HINTS ${CMAKE_CUDA_IMPLICIT_LINK_DIRECTORIES})
  find_package(Threads REQUIRED)
  add_library(${TARGET} STATIC cuda/andrea_clip_kernels.cu)
  target_include_directories(${TARGET} PRIVATE cuda)
  target_include_directories(${TARGET} INTERFACE ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
  target_compile_options(${TARGET} PRIVATE --expt-relaxed-constexpr -lineinfo)
  target_link_libraries(${TARGET} PUBLIC
                        "${CLIPJAX_CUDART_STATIC}" Threads::Threads ${CMAKE_DL_LIBS} rt)
  string(REPLACE ";" " " clipjax_architectures "${CMAKE_CUDA_ARCHITECTURES}")
  set_target_properties(${TARGET} PROPERTIES
    CLIPJAX_ARCHITECTURES "${clipjax_architectures}"
    CLIPJAX_COMPILER_VERSION "${CMAKE_CUDA_COMPILER_VERSION}")
  file(GENERATE OUTPUT "${CMAKE_CURRENT_BINARY_DIR}/kernels.cmake" CONTENT
"set(CLIPJAX_KERNELS_LIBRARY \"$<TARGET_FILE:${TARGET}>\")
set(CLIPJAX_KERNELS_ARCHITECTURES \"${clipjax_architectures}\")
set(CLIPJAX_KERNELS_COMPILER_VERSION \"${CMAKE_CUDA_COMPILER_VERSION}\")
set(CLIPJAX_KERNELS_INCLUDE_DIRS \"${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES}\")
set(CLIPJAX_KERNELS_RUNTIME \"${CLIPJAX_CUDART_STATIC}\")
")
endmacro()

# The kernels that DESCRIPTION (a kernels.cmake) describes, as the library TARGET.
function(clipjax_kernels_from DESCRIPTION TARGET)
  include("${DESCRIPTION}")
  find_package(Threads REQUIRED)
  add_library(${TARGET} STATIC IMPORTED GLOBAL)
  set_target_properties(${TARGET} PROPERTIES
    IMPORTED_LOCATION "${CLIPJAX_KERNELS_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CLIPJAX_KERNELS_INCLUDE_DIRS}"
    INTERFACE_LINK_LIBRARIES "${CLIPJAX_KERNELS_RUNTIME};Threads::Threads;${CMAKE_DL_LIBS};rt"
    CLIPJAX_ARCHITECTURES "${CLIPJAX_KERNELS_ARCHITECTURES}"
    CLIPJAX_COMPILER_VERSION "${CLIPJAX_KERNELS_COMPILER_VERSION}")
  message(STATUS "clipjax: linking the CUDA ${CLIPJAX_KERNELS_COMPILER_VERSION} kernels of "
                 "${CLIPJAX_KERNELS_LIBRARY} (${CLIPJAX_KERNELS_ARCHITECTURES})")
endfunction()

# The module NAME, installed as DESTINATION/_clipjax_cuda*.so (the name its NB_MODULE
# gives it), of the bindings and the handler linked with the library KERNELS.
function(clipjax_cuda_module NAME KERNELS DESTINATION)
  nanobind_add_module(${NAME} NB_STATIC cuda/bindings_cuda.cc cuda/andrea_clip_cuda.cc)
  set_target_properties(${NAME} PROPERTIES OUTPUT_NAME _clipjax_cuda
                        LIBRARY_OUTPUT_DIRECTORY "${CMAKE_CURRENT_BINARY_DIR}/${DESTINATION}")
  target_include_directories(${NAME} PRIVATE cuda "${XLA_FFI_INCLUDE_DIR}")
  get_target_property(architectures ${KERNELS} CLIPJAX_ARCHITECTURES)
  get_target_property(compiler ${KERNELS} CLIPJAX_COMPILER_VERSION)
  target_compile_definitions(${NAME} PRIVATE CLIPJAX_CUDA_ARCHITECTURES="${architectures}"
                                             CLIPJAX_CUDA_COMPILER_VERSION="${compiler}")
  target_link_libraries(${NAME} PRIVATE ${KERNELS})
  install(TARGETS ${NAME} LIBRARY DESTINATION ${DESTINATION})
endfunction()
