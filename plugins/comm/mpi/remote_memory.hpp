// Reading and writing another process's memory on this node (Linux
// cross-memory attach, process_vm_readv / process_vm_writev): one copy,
// straight between the peer's buffer and ours.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace meshrun::mpi {

// Copies `bytes` at address `remote` of process `pid` to `local`. Throws
// meshrun::plugin::Error: UNAVAILABLE when the process is gone, INTERNAL
// for any other failure.
void read_remote(pid_t pid, uint64_t remote, void* local, size_t bytes);
// Copies `bytes` at `local` to address `remote` of process `pid`; throws as
// read_remote.
void write_remote(pid_t pid, uint64_t remote, const void* local, size_t bytes);
// The same, answering false instead of throwing.
bool try_read_remote(pid_t pid, uint64_t remote, void* local, size_t bytes);
bool try_write_remote(pid_t pid, uint64_t remote, const void* local, size_t bytes);

}  // namespace meshrun::mpi
