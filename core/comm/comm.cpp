#include "comm/comm.hpp"

#include <fmt/format.h>

#include <utility>

#include "errors.hpp"
#include "plugin/call_scope.hpp"

namespace meshrun {

void throw_if_error(meshrun_error* error, const std::string& context) {
  if (error == nullptr) return;
  const int32_t code = error->code;
  std::string message = error->message != nullptr ? error->message : "(no message)";
  meshrun_error_release(error);
  throw Error(code, context.empty() ? message : context + ": " + message);
}

DLDataType dtype_float32() { return {kDLFloat, 32, 1}; }
DLDataType dtype_bfloat16() { return {kDLBfloat, 16, 1}; }
DLDataType dtype_float16() { return {kDLFloat, 16, 1}; }
DLDataType dtype_int32() { return {kDLInt, 32, 1}; }
DLDataType dtype_int64() { return {kDLInt, 64, 1}; }

namespace {

struct NamedDtype {
  const char* name;
  DLDataType (*make)();
};

constexpr NamedDtype kDtypes[] = {
    {"float32", dtype_float32}, {"bfloat16", dtype_bfloat16}, {"float16", dtype_float16},
    {"int32", dtype_int32},     {"int64", dtype_int64},
};

bool same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

}  // namespace

DLDataType dtype_from_name(const std::string& name) {
  std::string names;
  for (const auto& dtype : kDtypes) {
    if (name == dtype.name) return dtype.make();
    names += names.empty() ? dtype.name : std::string(", ") + dtype.name;
  }
  throw invalid_argument(fmt::format("unknown dtype '{}'; valid: {}", name, names));
}

std::string dtype_name(DLDataType dtype) {
  for (const auto& known : kDtypes) {
    if (same_dtype(dtype, known.make())) return known.name;
  }
  return fmt::format("dtype(code {}, bits {}, lanes {})", dtype.code, dtype.bits, dtype.lanes);
}

size_t dtype_bytes(DLDataType dtype) { return (size_t{dtype.bits} * dtype.lanes + 7) / 8; }

FlatTensor::FlatTensor(void* data, DLDataType dtype, int64_t numel, DLDevice device)
    : numel_(numel), tensor_{data, device, 1, dtype, &numel_, nullptr, 0} {}

Request::Request(Request&& other) noexcept
    : library_(other.library_), handle_(std::exchange(other.handle_, nullptr)) {}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    destroy_handle();
    library_ = other.library_;
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

Request::~Request() { destroy_handle(); }

void Request::destroy_handle() {
  if (handle_ == nullptr) return;
  call_plugin(*library_, "request_destroy",
              [&] { library_->api().comm->request_destroy(handle_); });
}

void Request::wait(double timeout_seconds) {
  if (handle_ == nullptr) return;
  throw_if_error(call_plugin(*library_, "wait",
                             [&] { return library_->api().comm->wait(handle_, timeout_seconds); }));
}

bool Request::test() {
  if (handle_ == nullptr) return true;
  int32_t done = 0;
  throw_if_error(
      call_plugin(*library_, "test", [&] { return library_->api().comm->test(handle_, &done); }));
  return done != 0;
}

Communicator::Communicator(std::shared_ptr<const PluginLibrary> library,
                           meshrun_communicator* handle, std::string name)
    : library_(std::move(library)), handle_(handle), name_(std::move(name)) {
  throw_if_error(call_plugin(*library_, "rank", [&] { return api().rank(handle_, &rank_); }),
                 "communicator " + name_);
  throw_if_error(call_plugin(*library_, "size", [&] { return api().size(handle_, &size_); }),
                 "communicator " + name_);
}

Communicator::Communicator(Communicator&& other) noexcept
    : library_(std::move(other.library_)),
      handle_(std::exchange(other.handle_, nullptr)),
      name_(std::move(other.name_)),
      rank_(other.rank_),
      size_(other.size_) {}

Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    destroy_handle();
    library_ = std::move(other.library_);
    handle_ = std::exchange(other.handle_, nullptr);
    name_ = std::move(other.name_);
    rank_ = other.rank_;
    size_ = other.size_;
  }
  return *this;
}

Communicator::~Communicator() { destroy_handle(); }

void Communicator::destroy_handle() {
  if (handle_ == nullptr) return;
  call_plugin(*library_, "communicator_destroy", [&] { api().communicator_destroy(handle_); });
}

Communicator Communicator::split(int64_t color, int64_t key, const std::string& name) {
  meshrun_communicator* child = nullptr;
  throw_if_error(
      call_plugin(*library_, "split",
                  [&] { return api().split(handle_, color, key, name.c_str(), &child); }),
      "split " + name_);
  return Communicator(library_, child, name);
}

void Communicator::set_stream(void* stream) {
  throw_if_error(
      call_plugin(*library_, "set_stream", [&] { return api().set_stream(handle_, stream); }),
      "set_stream on " + name_);
}

// Starts operation `entry_point` through `begin`, which receives the
// out-request slot.
template <class Begin>
Request Communicator::start(const char* entry_point, Begin&& begin) {
  meshrun_request* request = nullptr;
  throw_if_error(call_plugin(*library_, entry_point, [&] { return begin(&request); }),
                 std::string(entry_point) + " on " + name_);
  return Request(*library_, request);
}

Request Communicator::all_reduce(const DLTensor& send, DLTensor& recv, ReduceOp op) {
  return start("all_reduce", [&](meshrun_request** out) {
    return api().all_reduce(handle_, &send, &recv, static_cast<int32_t>(op), out);
  });
}

Request Communicator::all_gather(const DLTensor& send, DLTensor& recv) {
  return start("all_gather",
               [&](meshrun_request** out) { return api().all_gather(handle_, &send, &recv, out); });
}

Request Communicator::all_to_all(const DLTensor& send, const std::vector<int64_t>& send_counts,
                                 DLTensor& recv, const std::vector<int64_t>& recv_counts) {
  if (!MESHRUN_HAS_FIELD(meshrun_comm_api, &api(), all_to_all)) {
    throw Error(MESHRUN_UNIMPLEMENTED,
                fmt::format("comm plugin {} has no all_to_all (ABI 1.7)", library_->name()));
  }
  if (int64_t(send_counts.size()) != size_ || int64_t(recv_counts.size()) != size_) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                fmt::format("all_to_all on '{}' needs {} counts each way", name_, size_));
  }
  return start("all_to_all", [&](meshrun_request** out) {
    return api().all_to_all(handle_, &send, send_counts.data(), &recv, recv_counts.data(), out);
  });
}

Request Communicator::reduce_scatter(const DLTensor& send, DLTensor& recv, ReduceOp op) {
  return start("reduce_scatter", [&](meshrun_request** out) {
    return api().reduce_scatter(handle_, &send, &recv, static_cast<int32_t>(op), out);
  });
}

Request Communicator::broadcast(DLTensor& tensor, int64_t root) {
  return start("broadcast",
               [&](meshrun_request** out) { return api().broadcast(handle_, &tensor, root, out); });
}

Request Communicator::send(const DLTensor& tensor, int64_t peer, int64_t tag) {
  return start("send",
               [&](meshrun_request** out) { return api().send(handle_, &tensor, peer, tag, out); });
}

Request Communicator::recv(DLTensor& tensor, int64_t peer, int64_t tag) {
  return start("recv",
               [&](meshrun_request** out) { return api().recv(handle_, &tensor, peer, tag, out); });
}

Request Communicator::barrier() {
  return start("barrier", [&](meshrun_request** out) { return api().barrier(handle_, out); });
}

namespace {

std::shared_ptr<PluginLibrary> require_comm_functions(std::shared_ptr<PluginLibrary> library) {
  const meshrun_comm_api* comm = library->api().comm;
  if (comm->struct_size < MESHRUN_COMM_API_SIZE_1_1) {
    throw Error(MESHRUN_VERSION_MISMATCH,
                fmt::format("comm plugin {}: its table (ABI {}.{}, {} bytes) lacks the "
                            "communication functions of ABI 1.1 ({} bytes)",
                            library->path(), library->api().abi_major, library->api().abi_minor,
                            comm->struct_size, MESHRUN_COMM_API_SIZE_1_1));
  }
  return library;
}

}  // namespace

CommBackend::CommBackend(const PluginLoader& loader, const std::string& name)
    : CommBackend(loader.load(PluginKind::comm, name)) {}

CommBackend::CommBackend(std::shared_ptr<PluginLibrary> library)
    : library_(require_comm_functions(std::move(library))), instance_(library_) {}

Communicator CommBackend::world(double timeout_seconds, int32_t device_id,
                                const meshrun_bootstrap* bootstrap) {
  const meshrun_comm_options options{sizeof(meshrun_comm_options), timeout_seconds, device_id,
                                     nullptr};
  meshrun_communicator* handle = nullptr;
  throw_if_error(call_plugin(*library_, "world",
                             [&] {
                               return library_->api().comm->world(instance_.handle(), bootstrap,
                                                                  &options, &handle);
                             }),
                 "comm plugin " + library_->path() + ": world");
  return Communicator(library_, handle, "world");
}

MeshCommunicators::MeshCommunicators(Communicator& world, const MeshContext& mesh) {
  if (world.size() != mesh.world_size()) {
    throw invalid_argument(fmt::format("the job has {} ranks but the mesh was resolved for {}",
                                       world.size(), mesh.world_size()));
  }
  std::vector<Axis> axes(kMeshAxes.begin(), kMeshAxes.end());
  axes.insert(axes.end(), kFlattenedAxes.begin(), kFlattenedAxes.end());
  if (mesh.has_moe()) axes.insert(axes.end(), kMoeAxes.begin(), kMoeAxes.end());
  const int64_t rank = world.rank();
  for (Axis axis : axes) {
    // The group's lowest rank names it uniquely; the axis index orders it.
    const int64_t color = mesh.group_ranks(axis, rank).front();
    by_axis_.emplace(axis,
                     world.split(color, mesh.coordinate(rank, axis), std::string(axis_name(axis))));
  }
}

Communicator& MeshCommunicators::axis(Axis axis) {
  const auto found = by_axis_.find(axis);
  if (found == by_axis_.end()) {
    throw Error(MESHRUN_NOT_FOUND,
                fmt::format("no communicator for axis '{}' (no MoE mesh?)", axis_name(axis)));
  }
  return found->second;
}

}  // namespace meshrun
