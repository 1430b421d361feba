/*
 * numeric/cuda/peak_entry.h — the entry point of libmeshrun_cuda_peak.so,
 * which `meshrun bench peak --device cuda` loads at run time (the CLI links
 * no CUDA library, so it runs where there is none).
 */
#ifndef MESHRUN_NUMERIC_CUDA_PEAK_ENTRY_H_
#define MESHRUN_NUMERIC_CUDA_PEAK_ENTRY_H_

#include <stddef.h>
#include <stdint.h>

#define MESHRUN_CUDA_PEAK_LIBRARY "libmeshrun_cuda_peak.so"
#define MESHRUN_CUDA_PEAK_SYMBOL "meshrun_cuda_gemm_peak"

/* What one measurement found on one GPU. */
typedef struct meshrun_cuda_peak {
  char device_name[256];   /* cudaDeviceProp::name */
  double gemm_flops_per_s; /* bfloat16 n x n x n GEMM, float32 accumulation and output */
  double copy_bytes_per_s; /* device-to-device copy, bytes read plus written */
} meshrun_cuda_peak;

/* Measures CUDA device `device` for about `seconds` per figure, with GEMMs
 * of size `n` (A B^T, as a linear's forward, through cuBLASLt). Returns 0
 * and fills *out, or nonzero and writes what failed into `why` (at most
 * why_size bytes, NUL-terminated). */
typedef int (*meshrun_cuda_gemm_peak_fn)(int32_t device, int64_t n, double seconds,
                                         meshrun_cuda_peak* out, char* why, size_t why_size);

#endif /* MESHRUN_NUMERIC_CUDA_PEAK_ENTRY_H_ */
