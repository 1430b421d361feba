# MESHRUN_SANITIZE: AddressSanitizer + UndefinedBehaviorSanitizer for every
# host target, plugins included; the CUDA/NCCL targets are left out
# (cmake/MeshrunCuda.cmake says why). scripts/test.sh builds such a tree
# with clang in build-sanitize/ (docs/testing.md).
#
# -O0 (after the build type's level, so it wins): instrumented code compiles
# in about half the time of -O1 (docs/decisions.md). The files whose tests
# are long loops are compiled at MESHRUN_SANITIZE_LOOP_OPTIONS (-O1: the comm test,
# mesh, its oracle, the models' double-precision references), the model
# kernels at their own -O3. Line
# tables (-g1) are all the reports need, at a fraction of full debug
# information's compile time. Assertions are on (-UNDEBUG): a sanitized
# build is there to find what is wrong. Every report fails its test: UBSan aborts
# (-fno-sanitize-recover), ASan and LSan exit non-zero.
#
# Sets, for the tests: MESHRUN_SANITIZE_RUNTIME, the ASan runtime a process
# that is not instrumented (python3) must preload; MESHRUN_FUZZ, whether the
# compiler brings libFuzzer (clang), in which case the core carries its
# coverage instrumentation and tests/fuzz builds the fuzz targets.
option(MESHRUN_SANITIZE "Build with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)
set(MESHRUN_FUZZ OFF CACHE INTERNAL "Whether the fuzz targets are libFuzzer programs")
if(NOT MESHRUN_SANITIZE)
  return()
endif()

set(MESHRUN_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined
  -fno-omit-frame-pointer)
add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${MESHRUN_SANITIZE_FLAGS};-O0;-g1;-UNDEBUG>")
set(MESHRUN_SANITIZE_LOOP_OPTIONS -O1)
add_link_options("$<$<LINK_LANGUAGE:C,CXX>:${MESHRUN_SANITIZE_FLAGS}>")
# core/support/sanitized_keep_loaded.cpp replaces dlclose for the process:
# every executable takes it from libmeshrun_core.a and exports it.
add_link_options("$<$<STREQUAL:$<TARGET_PROPERTY:TYPE>,EXECUTABLE>:-Wl,--undefined=meshrun_sanitized_keep_loaded,--export-dynamic-symbol=dlclose>")

if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # g++ 12's -Wmaybe-uninitialized misfires on instrumented code (inside
  # libstdc++'s <regex>); the plain build keeps the warning as an error.
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-Wno-maybe-uninitialized>")
  execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=libasan.so
    OUTPUT_VARIABLE MESHRUN_SANITIZE_RUNTIME OUTPUT_STRIP_TRAILING_WHITESPACE)
  return()
endif()

# clang links its sanitizer runtime into executables only, and a plugin
# built with -Wl,--no-undefined must resolve the runtime's symbols: every
# target links the shared runtime instead (-shared-libsan), found at run
# time through an rpath to clang's runtime folder.
execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=libclang_rt.asan-x86_64.so
  OUTPUT_VARIABLE MESHRUN_SANITIZE_RUNTIME OUTPUT_STRIP_TRAILING_WHITESPACE)
get_filename_component(clang_runtime_dir "${MESHRUN_SANITIZE_RUNTIME}" DIRECTORY)
add_link_options("$<$<LINK_LANGUAGE:C,CXX>:-shared-libsan;-Wl,-rpath,${clang_runtime_dir}>")

execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=libclang_rt.fuzzer-x86_64.a
  OUTPUT_VARIABLE fuzzer_runtime OUTPUT_STRIP_TRAILING_WHITESPACE)
if(EXISTS "${fuzzer_runtime}")
  set(MESHRUN_FUZZ ON CACHE INTERNAL "Whether the fuzz targets are libFuzzer programs")
endif()
