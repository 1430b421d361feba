// Non-temporal stores: writes that go to memory without first reading the
// destination's cache lines (a read for ownership) and without evicting
// what the caches hold. Large all_reduce results are written this way, since
// the caller reads them long after and ordinary stores would move a third
// more bytes through DRAM. The stores are weakly ordered: stream_fence()
// must follow before another thread or process may read what they wrote.
//
// Which store instructions are used is fixed at compile time: the plugin's
// sources are all built with the same flags (MESHRUN_NATIVE), so this
// header's inline code is the same in each.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace meshrun::mpi {

// Bytes of a cache line, the unit of a non-temporal store.
constexpr size_t kLineBytes = 64;

// Copies one cache line from `src` to `dst`; `dst` aligned to a line.
// Inline, since the reductions call it once per line. With AVX-512 one store
// fills a write-combining buffer at once: 10.0 against 8.7 GB/s with four
// 16-byte stores, for a 256 MiB copy on one core here. SSE2 is in every
// x86-64.
inline void stream_line(void* dst, const void* src) {
#if defined(__AVX512F__)
  _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_loadu_si512(src));
#elif defined(__SSE2__)
  auto* to = static_cast<__m128i*>(dst);
  const auto* from = static_cast<const __m128i*>(src);
  for (int part = 0; part < 4; ++part) _mm_stream_si128(to + part, _mm_loadu_si128(from + part));
#else
  std::memcpy(dst, src, kLineBytes);
#endif
}

// memcpy through non-temporal stores; any alignment.
void stream_copy(void* dst, const void* src, size_t bytes);

// Orders every earlier non-temporal store before later stores.
void stream_fence();

inline bool line_aligned(const void* address) {
  return reinterpret_cast<uintptr_t>(address) % kLineBytes == 0;
}

}  // namespace meshrun::mpi
