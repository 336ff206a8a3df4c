# cuda.cmake — the CUDA backend, included by the top-level CMakeLists.txt when
# TITAN_CUDA is on, after titan_core is defined and before libtitan is made.
#
# The architectures are ours, not CMake's: CMake 3.25 does not know sm_90a,
# so CMAKE_CUDA_ARCHITECTURES is OFF and the -gencode flags below say it all:
# Hopper (sm_90a for wgmma/TMA kernels, sm_90), Ampere (sm_80), and sm_90 PTX
# so newer GPUs can JIT.

if(NOT CMAKE_CUDA_COMPILER)
  set(CMAKE_CUDA_COMPILER ${TITAN_NVCC})
endif()
set(CMAKE_CUDA_ARCHITECTURES OFF)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
# libtitan links the shared cudart (as cuBLASLt, cuDNN and NCCL do), never a
# second static copy.
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(TITAN_CUDA_GENCODE
    "SHELL:-gencode arch=compute_90a,code=sm_90a" "SHELL:-gencode arch=compute_90,code=sm_90"
    "SHELL:-gencode arch=compute_80,code=sm_80" "SHELL:-gencode arch=compute_90,code=compute_90")
# nvcc compiles the four targets of a file one after another unless told to
# use threads; the GPU check (16 cores, few files left at the end) asks for 4.
set(TITAN_NVCC_THREADS 1 CACHE STRING "threads nvcc uses per file for its -gencode targets")
if(TITAN_NVCC_THREADS GREATER 1)
  list(APPEND TITAN_CUDA_GENCODE "--threads=${TITAN_NVCC_THREADS}")
endif()
set(TITAN_CUDA_WARNINGS -Xcompiler=-Wall,-Wextra)
if(TITAN_WERROR)
  list(APPEND TITAN_CUDA_WARNINGS "SHELL:-Werror all-warnings" -Xcompiler=-Werror)
endif()

# titan_core's warning flags are gcc's: keep them to C sources, nvcc gets its own.
get_target_property(_titan_core_opts titan_core COMPILE_OPTIONS)
if(_titan_core_opts)
  set_property(TARGET titan_core PROPERTY COMPILE_OPTIONS "$<$<COMPILE_LANGUAGE:C>:${_titan_core_opts}>")
endif()

# cuDNN and NCCL may live in the toolkit or in the system's library paths.
find_library(TITAN_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}
             PATH_SUFFIXES lib64 lib)
find_library(TITAN_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}
             PATH_SUFFIXES lib64 lib)
find_path(TITAN_CUDNN_INCLUDE cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
find_path(TITAN_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
foreach(_v TITAN_CUDNN_LIBRARY TITAN_NCCL_LIBRARY TITAN_CUDNN_INCLUDE TITAN_NCCL_INCLUDE)
  if(NOT ${_v})
    string(REGEX REPLACE "^TITAN_([A-Z]+)_.*" "\\1" _lib ${_v})
    string(TOLOWER ${_lib} _lib)
    message(FATAL_ERROR "TITAN_CUDA: ${_lib} not found (${_v}); looked in ${CUDAToolkit_LIBRARY_DIR}, "
                        "${CUDAToolkit_INCLUDE_DIRS} and the system paths. Install ${_lib}, set ${_v}, "
                        "or configure with -DTITAN_CUDA=OFF.")
  endif()
endforeach()
if(NOT TARGET CUDA::cublasLt OR NOT TARGET CUDA::cublas)
  message(FATAL_ERROR "TITAN_CUDA: cuBLAS or cuBLASLt not found in the CUDA toolkit at ${CUDAToolkit_LIBRARY_DIR}")
endif()

# titan_core predates this file, so it did not see CMAKE_CUDA_ARCHITECTURES.
set_target_properties(titan_core PROPERTIES CUDA_ARCHITECTURES OFF)
file(GLOB TITAN_CUDA_SRC CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/kernels/cuda/*.cu)
target_sources(titan_core PRIVATE ${TITAN_CUDA_SRC})
target_include_directories(titan_core PRIVATE ${TITAN_CUDNN_INCLUDE} ${TITAN_NCCL_INCLUDE})
target_compile_options(titan_core PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:${TITAN_CUDA_GENCODE};${TITAN_CUDA_WARNINGS}>")
target_compile_definitions(titan_core PUBLIC TITAN_HAVE_CUDA=1)
target_link_libraries(titan_core PUBLIC CUDA::cudart CUDA::cublas CUDA::cublasLt ${TITAN_CUDNN_LIBRARY} ${TITAN_NCCL_LIBRARY})
message(STATUS "TITAN_CUDA: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, cudnn ${TITAN_CUDNN_LIBRARY}, nccl ${TITAN_NCCL_LIBRARY}")
