#include "nontemporal.hpp"

#include <algorithm>
#include <cstring>

namespace meshrun::mpi {

void stream_copy(void* dst, const void* src, size_t bytes) {
  auto* to = static_cast<std::byte*>(dst);
  const auto* from = static_cast<const std::byte*>(src);
  const size_t head =
      std::min(bytes, (kLineBytes - reinterpret_cast<uintptr_t>(to) % kLineBytes) % kLineBytes);
  std::memcpy(to, from, head);
  size_t done = head;
  for (; done + kLineBytes <= bytes; done += kLineBytes) stream_line(to + done, from + done);
  std::memcpy(to + done, from + done, bytes - done);
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace meshrun::mpi
