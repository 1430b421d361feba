// What oneDNN may use on this CPU, shared by the models' GEMMs and the peak
// they are measured against (header-only, as tensor/elements.hpp, so that
// plugins include it without linking the core).
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

namespace meshrun {

// Whether oneDNN may use the CPU's bfloat16 instructions (AVX512_BF16 or
// newer; ONEDNN_MAX_CPU_ISA can withhold them). Without them a bfloat16
// matmul is computed as float32 products of rounded operands: the same
// numbers at float32's speed.
inline bool onednn_native_bfloat16() {
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (isa & bf16) == bf16;
}

}  // namespace meshrun
