#include "remote_memory.hpp"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "meshrun/plugin.hpp"

namespace meshrun::mpi {
namespace {

using Transfer = ssize_t (*)(pid_t, const iovec*, unsigned long, const iovec*, unsigned long,
                             unsigned long);

// Moves all `bytes` with `transfer` (process_vm_readv or _writev); returns 0
// or the errno of the failure (EFAULT for a transfer that stops short).
int transfer_all(Transfer transfer, pid_t pid, uint64_t remote, void* local, size_t bytes) {
  auto* at = static_cast<char*>(local);
  while (bytes > 0) {
    const iovec local_iov{at, bytes};
    const iovec remote_iov{reinterpret_cast<void*>(remote), bytes};
    const ssize_t moved = transfer(pid, &local_iov, 1, &remote_iov, 1, 0);
    if (moved < 0 && errno == EINTR) continue;
    if (moved < 0) return errno;
    if (moved == 0) return EFAULT;
    at += moved;
    remote += static_cast<uint64_t>(moved);
    bytes -= static_cast<size_t>(moved);
  }
  return 0;
}

void throw_on_error(int error, const char* call, pid_t pid, size_t bytes) {
  if (error == 0) return;
  throw meshrun::plugin::Error(error == ESRCH ? MESHRUN_UNAVAILABLE : MESHRUN_INTERNAL,
                               std::string(call) + " of " + std::to_string(bytes) +
                                   " bytes with process " + std::to_string(pid) + ": " +
                                   std::strerror(error));
}

}  // namespace

void read_remote(pid_t pid, uint64_t remote, void* local, size_t bytes) {
  throw_on_error(transfer_all(&process_vm_readv, pid, remote, local, bytes), "process_vm_readv",
                 pid, bytes);
}

void write_remote(pid_t pid, uint64_t remote, const void* local, size_t bytes) {
  // process_vm_writev only reads the local iovec's memory.
  throw_on_error(transfer_all(&process_vm_writev, pid, remote, const_cast<void*>(local), bytes),
                 "process_vm_writev", pid, bytes);
}

bool try_read_remote(pid_t pid, uint64_t remote, void* local, size_t bytes) {
  return transfer_all(&process_vm_readv, pid, remote, local, bytes) == 0;
}

bool try_write_remote(pid_t pid, uint64_t remote, const void* local, size_t bytes) {
  return transfer_all(&process_vm_writev, pid, remote, const_cast<void*>(local), bytes) == 0;
}

}  // namespace meshrun::mpi
