// The core's side of the comm ABI (meshrun/comm.h): a loaded backend, its
// communicators and requests as RAII C++ objects that throw meshrun::Error,
// and one communicator per mesh axis.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "mesh/mesh.hpp"
#include "meshrun/comm.h"
#include "plugin/loader.hpp"

namespace meshrun {

enum class ReduceOp : int32_t {
  sum = MESHRUN_REDUCE_SUM,
  avg = MESHRUN_REDUCE_AVG,
  max = MESHRUN_REDUCE_MAX,
};

// DLPack data types by name.
DLDataType dtype_float32();
DLDataType dtype_bfloat16();
DLDataType dtype_float16();
DLDataType dtype_int32();
DLDataType dtype_int64();
// "float32", "bfloat16", ...; throws INVALID_ARGUMENT for other names.
DLDataType dtype_from_name(const std::string& name);
std::string dtype_name(DLDataType dtype);
size_t dtype_bytes(DLDataType dtype);

// A one-dimensional DLTensor view of `numel` elements at `data`. Not
// copyable: the DLTensor's shape points into the object.
class FlatTensor {
 public:
  FlatTensor(void* data, DLDataType dtype, int64_t numel, DLDevice device = {kDLCPU, 0});
  FlatTensor(const FlatTensor&) = delete;
  FlatTensor& operator=(const FlatTensor&) = delete;

  DLTensor& get() { return tensor_; }
  const DLTensor& get() const { return tensor_; }
  int64_t numel() const { return numel_; }

 private:
  int64_t numel_;
  DLTensor tensor_;
};

// An operation in flight. Move-only; destroying it waits for it (up to the
// world timeout). A default-constructed Request is already complete.
class Request {
 public:
  Request() = default;
  // Owns `handle`, made by the comm plugin `library`, which outlives it.
  Request(const PluginLibrary& library, meshrun_request* handle)
      : library_(&library), handle_(handle) {}
  Request(Request&& other) noexcept;
  Request& operator=(Request&& other) noexcept;
  ~Request();

  // Blocks until complete; throws the operation's error. timeout < 0: the
  // world's timeout.
  void wait(double timeout_seconds = -1.0);
  // True when complete.
  bool test();

 private:
  void destroy_handle();

  const PluginLibrary* library_ = nullptr;
  meshrun_request* handle_ = nullptr;
};

class Communicator {
 public:
  Communicator(std::shared_ptr<const PluginLibrary> library, meshrun_communicator* handle,
               std::string name);
  Communicator(Communicator&&) noexcept;
  Communicator& operator=(Communicator&&) noexcept;
  ~Communicator();

  const std::string& name() const { return name_; }
  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  // The raw handle and the backend's table, for handing the communicator to
  // a plugin (a strategy's setup). The handle stays owned by this object.
  meshrun_communicator* handle() const { return handle_; }
  const meshrun_comm_api& comm_api() const { return api(); }

  // Collective over this communicator: ranks passing the same color form
  // one communicator, ordered by key.
  Communicator split(int64_t color, int64_t key, const std::string& name);
  void set_stream(void* stream);

  // Every operation starts asynchronously and returns its request.
  Request all_reduce(const DLTensor& send, DLTensor& recv, ReduceOp op);
  Request all_reduce(DLTensor& tensor, ReduceOp op) { return all_reduce(tensor, tensor, op); }
  Request all_gather(const DLTensor& send, DLTensor& recv);
  Request reduce_scatter(const DLTensor& send, DLTensor& recv, ReduceOp op);
  Request broadcast(DLTensor& tensor, int64_t root);
  Request send(const DLTensor& tensor, int64_t peer, int64_t tag = 0);
  Request recv(DLTensor& tensor, int64_t peer, int64_t tag = 0);
  Request barrier();
  // ABI 1.7's all-to-all with per-rank counts (meshrun/comm.h); a backend
  // without it is UNIMPLEMENTED.
  Request all_to_all(const DLTensor& send, const std::vector<int64_t>& send_counts, DLTensor& recv,
                     const std::vector<int64_t>& recv_counts);

 private:
  const meshrun_comm_api& api() const { return *library_->api().comm; }
  void destroy_handle();
  template <class Begin>
  Request start(const char* entry_point, Begin&& begin);

  std::shared_ptr<const PluginLibrary> library_;
  meshrun_communicator* handle_ = nullptr;
  std::string name_;
  int64_t rank_ = 0;
  int64_t size_ = 1;
};

// A comm plugin, loaded and instantiated. Outlives its communicators.
class CommBackend {
 public:
  // Loads comm plugin `name` and checks its table has the ABI 1.1 functions.
  CommBackend(const PluginLoader& loader, const std::string& name);
  explicit CommBackend(std::shared_ptr<PluginLibrary> library);

  const PluginLibrary& library() const { return instance_.library(); }
  // The world communicator; collective over the job. `bootstrap` may be
  // null for backends that find their peers themselves (MPI).
  Communicator world(double timeout_seconds, int32_t device_id = 0,
                     const meshrun_bootstrap* bootstrap = nullptr);

 private:
  std::shared_ptr<PluginLibrary> library_;
  PluginInstance instance_;
};

// This rank's communicator for every axis of the mesh (mesh axes, flattened
// axes, and the MoE axes when there is an MoE mesh), split from `world` in
// a fixed order so every rank makes the same collective calls.
class MeshCommunicators {
 public:
  MeshCommunicators(Communicator& world, const MeshContext& mesh);
  Communicator& axis(Axis axis);

 private:
  std::map<Axis, Communicator> by_axis_;
};

// Throws a meshrun::Error carrying `error`'s code and message (prefixed with
// `context` when non-empty), releasing `error` through its own destroy. Does
// nothing for NULL.
void throw_if_error(meshrun_error* error, const std::string& context = {});

}  // namespace meshrun
