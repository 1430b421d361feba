# Finds the CUDA toolkit and NCCL (in /usr/local/cuda on these machines) and
# sets MESHRUN_WITH_CUDA. Elsewhere the CUDA/NCCL targets are skipped with one
# message. A machine without a GPU still builds everything; GPU tests skip.
# A sanitized build (MESHRUN_SANITIZE) skips them too: ASan's shadow memory
# collides with the CUDA driver's address space, nvcc's device code cannot be
# instrumented, and the CI machines have no GPU to run them on.
include(CheckLanguage)
set(MESHRUN_WITH_CUDA OFF)
if(MESHRUN_SANITIZE)
  message(STATUS "meshrun: sanitized build; CUDA/NCCL targets are skipped")
  return()
endif()
if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS "/usr/local/cuda/bin/nvcc")
  set(CMAKE_CUDA_COMPILER "/usr/local/cuda/bin/nvcc")
endif()
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  find_library(MESHRUN_NCCL_LIBRARY nccl HINTS "${CUDAToolkit_LIBRARY_DIR}" /usr/local/cuda/lib64)
  find_path(MESHRUN_NCCL_INCLUDE_DIR nccl.h HINTS "${CUDAToolkit_INCLUDE_DIRS}" /usr/local/cuda/include)
  set(MESHRUN_WITH_CUDA ON)
  # CMake 3.25 knows no CUDA20 dialect for nvcc; device code stays C++17.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  # nvcc spells warnings differently; host code gets the project's flags.
  add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>")
  if(MESHRUN_WERROR)
    add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings;-Xcompiler=-Werror>")
  endif()
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "52")
    # Hopper first (the GPU machines lent here are H200s), plus PTX for others.
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  message(STATUS "meshrun: CUDA ${CUDAToolkit_VERSION} found; building CUDA/NCCL targets (NCCL: ${MESHRUN_NCCL_LIBRARY})")
else()
  message(STATUS "meshrun: no CUDA toolkit found; CUDA/NCCL targets are skipped")
endif()
