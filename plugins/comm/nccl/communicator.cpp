// The nccl backend's communicators and requests (see communicator.hpp).
#include "communicator.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "meshrun/plugin.hpp"

// CMakeLists.txt skips the plugin for an older NCCL: the core splits the world
// into one communicator per mesh axis, which needs ncclCommSplit.
static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0), "the nccl plugin needs NCCL >= 2.18");

namespace meshrun::nccl {

namespace {

using plugin::Error;

std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds << " s";
  return text.str();
}

int32_t code_of(cudaError_t status) {
  switch (status) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
      return MESHRUN_UNAVAILABLE;
    case cudaErrorInvalidDevice:
      return MESHRUN_INVALID_ARGUMENT;
    default:
      return MESHRUN_INTERNAL;
  }
}

int32_t code_of(ncclResult_t result) {
  switch (result) {
    case ncclRemoteError:
    case ncclSystemError:
      return MESHRUN_UNAVAILABLE;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return MESHRUN_INVALID_ARGUMENT;
    default:
      return MESHRUN_INTERNAL;
  }
}

std::string cuda_text(cudaError_t status) {
  return std::string(cudaGetErrorName(status)) + " (" + cudaGetErrorString(status) + ")";
}

// NCCL's name for `result` plus its last error message, which says which peer
// or call failed where it knows.
std::string nccl_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(": ") + last;
  return text;
}

void check_cuda(cudaError_t status, const std::string& context, const char* call) {
  if (status == cudaSuccess) return;
  // Clears a non-sticky error from the thread's CUDA state, so the host's own
  // cudaGetLastError checks do not report our failure as theirs.
  cudaGetLastError();
  throw Error(code_of(status), context + ": " + call + " failed: " + cuda_text(status));
}

void check_nccl(ncclResult_t result, const std::string& context, const char* call,
                ncclComm_t comm) {
  if (result == ncclSuccess) return;
  throw Error(code_of(result), context + ": " + call + " failed: " + nccl_text(result, comm));
}

// Makes `device` current for the guard's lifetime, then restores the previous
// device, touching the thread's CUDA state only when they differ.
class DeviceGuard {
 public:
  DeviceGuard(int device, const std::string& context) : device_(device) {
    check_cuda(cudaGetDevice(&previous_), context, "cudaGetDevice");
    if (previous_ != device_) check_cuda(cudaSetDevice(device_), context, "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

std::optional<std::pair<ncclDataType_t, size_t>> nccl_type(DLDataType dtype) {
  if (dtype.lanes != 1) return std::nullopt;
  if (dtype.code == kDLFloat && dtype.bits == 32) return std::pair{ncclFloat32, size_t{4}};
  if (dtype.code == kDLBfloat && dtype.bits == 16) return std::pair{ncclBfloat16, size_t{2}};
  if (dtype.code == kDLFloat && dtype.bits == 16) return std::pair{ncclFloat16, size_t{2}};
  if (dtype.code == kDLInt && dtype.bits == 32) return std::pair{ncclInt32, size_t{4}};
  if (dtype.code == kDLInt && dtype.bits == 64) return std::pair{ncclInt64, size_t{8}};
  return std::nullopt;
}

ncclRedOp_t nccl_op(int32_t op, const std::string& context) {
  switch (op) {
    case MESHRUN_REDUCE_SUM:
      return ncclSum;
    case MESHRUN_REDUCE_AVG:
      return ncclAvg;
    case MESHRUN_REDUCE_MAX:
      return ncclMax;
    default:
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  context + ": reduction op " + std::to_string(op) +
                      " is not MESHRUN_REDUCE_SUM (0), MESHRUN_REDUCE_AVG (1) or "
                      "MESHRUN_REDUCE_MAX (2)");
  }
}

bool overlap(const Buffer& a, const Buffer& b) {
  return a.bytes() > 0 && b.bytes() > 0 && a.data < b.data + b.bytes() &&
         b.data < a.data + a.bytes();
}

void require_same_dtype(const Buffer& send, const Buffer& recv, const std::string& context) {
  if (send.type != recv.type) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + ": send and recv have different dtypes");
  }
}

// Layout of the unique id rank 0 broadcasts: its ncclGetUniqueId result
// travels with it, so that a failure there ends every rank's world() with a
// message instead of leaving them in ncclCommInitRank.
struct UniqueIdMessage {
  int32_t status;
  ncclUniqueId id;
};

}  // namespace

Request::Request(Communicator& communicator, const char* op, cudaEvent_t event)
    : communicator_(communicator), op_(op), event_(event) {}

Request::~Request() { cudaEventDestroy(event_); }

bool Request::poll() {
  if (done_) return true;
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaSuccess) {
    done_ = true;
    return true;
  }
  if (status != cudaErrorNotReady) {
    cudaGetLastError();
    done_ = true;
    failure_code_ = MESHRUN_INTERNAL;
    failure_ = communicator_.describe(op_) + ": CUDA failed: " + cuda_text(status);
    return true;
  }
  // A peer that died or a broken network never lets the stream pass the
  // event; NCCL reports that as an asynchronous error of the communicator.
  if (auto error = communicator_.async_error()) {
    done_ = true;
    failure_code_ = error->first;
    failure_ = communicator_.describe(op_) + ": " + error->second;
    return true;
  }
  return false;
}

bool Request::test() { return poll(); }

void Request::wait(double timeout_seconds) {
  const bool world_limit = timeout_seconds < 0;
  const double limit = world_limit ? communicator_.timeout_seconds() : timeout_seconds;
  const bool limited = !world_limit || limit > 0;
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Short operations complete within microseconds, so the first polls only
  // yield; after that the pause grows to 1 ms so a long wait leaves the core
  // to the host's own threads.
  constexpr auto kSpin = std::chrono::microseconds(200);
  constexpr auto kLongestPause = std::chrono::microseconds(1000);
  auto pause = std::chrono::microseconds(50);
  while (!poll()) {
    const auto elapsed = Clock::now() - start;
    if (limited && elapsed >= std::chrono::duration<double>(limit)) {
      throw Error(MESHRUN_DEADLINE_EXCEEDED, communicator_.describe(op_) +
                                                 " did not complete within " + seconds_text(limit) +
                                                 "; it is still in flight");
    }
    if (elapsed < kSpin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, kLongestPause);
    }
  }
  if (failure_code_ != MESHRUN_OK) throw Error(failure_code_, failure_);
}

void Request::settle() {
  if (done_) return;
  try {
    wait(-1.0);
  } catch (const Error& e) {
    if (e.code() == MESHRUN_DEADLINE_EXCEEDED) {
      // Releasing the event is still safe: CUDA frees it once the stream
      // passes it. The memory the operation uses is the caller's concern.
      communicator_.log(MESHRUN_LOG_WARNING,
                        std::string("request released while in flight: ") + e.what());
    }
  }
}

Communicator::Communicator(const meshrun_host_services& host, ncclComm_t comm, int device,
                           std::string name, double timeout_seconds)
    : host_(&host),
      comm_(comm),
      device_(device),
      name_(std::move(name)),
      timeout_seconds_(timeout_seconds) {
  const std::string context = "nccl setup of communicator '" + name_ + "'";
  try {
    int rank = 0;
    int size = 0;
    check_nccl(ncclCommUserRank(comm_, &rank), context, "ncclCommUserRank", comm_);
    check_nccl(ncclCommCount(comm_, &size), context, "ncclCommCount", comm_);
    rank_ = rank;
    size_ = size;
    DeviceGuard device_guard(device_, context);
    check_cuda(cudaMalloc(&barrier_scratch_, sizeof(int32_t)), context, "cudaMalloc");
  } catch (...) {
    ncclCommDestroy(comm_);
    throw;
  }
}

Communicator::~Communicator() {
  // A communicator that failed since its last wait is aborted rather than
  // flushed (async_error() does that): a flush would wait for peers that are
  // gone. An aborted one's NCCL resources went with ncclCommAbort.
  if (!async_error()) {
    const ncclResult_t result = ncclCommDestroy(comm_);
    if (result != ncclSuccess) {
      log(MESHRUN_LOG_WARNING,
          describe("destroy") + ": ncclCommDestroy failed: " + ncclGetErrorString(result));
    }
  }
  // Last: cudaFree synchronizes the device, which must not wait for NCCL
  // kernels of a failed communicator.
  cudaFree(barrier_scratch_);
}

std::unique_ptr<Communicator> Communicator::world(const meshrun_host_services& host,
                                                  const meshrun_bootstrap& bootstrap,
                                                  const meshrun_comm_options& options) {
  const std::string context = "nccl world";
  if (bootstrap.size < 1 || bootstrap.size > INT_MAX || bootstrap.rank < 0 ||
      bootstrap.rank >= bootstrap.size) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + ": bootstrap rank " +
                                              std::to_string(bootstrap.rank) + " of size " +
                                              std::to_string(bootstrap.size) + " is out of range");
  }
  int devices = 0;
  check_cuda(cudaGetDeviceCount(&devices), context + ": no usable CUDA device",
             "cudaGetDeviceCount");
  if (devices == 0) throw Error(MESHRUN_UNAVAILABLE, context + ": no CUDA device is visible");
  if (options.device_id < 0 || options.device_id >= devices) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + ": device_id " +
                                              std::to_string(options.device_id) +
                                              " is out of range: this process sees " +
                                              std::to_string(devices) + " CUDA device(s)");
  }
  check_cuda(cudaSetDevice(options.device_id), context, "cudaSetDevice");

  UniqueIdMessage message{};
  if (bootstrap.rank == 0) message.status = ncclGetUniqueId(&message.id);
  if (meshrun_error* error =
          bootstrap.broadcast(bootstrap.context, &message, sizeof message, /*root=*/0)) {
    const int32_t code = error->code;
    const std::string text = error->message != nullptr ? error->message : "";
    meshrun_error_release(error);
    throw Error(code,
                context + ": the bootstrap's broadcast of the NCCL unique id failed: " + text);
  }
  const auto status = static_cast<ncclResult_t>(message.status);
  if (status != ncclSuccess) {
    throw Error(code_of(status),
                context + ": rank 0 could not make the NCCL unique id: ncclGetUniqueId failed: " +
                    ncclGetErrorString(status));
  }

  ncclComm_t comm = nullptr;
  const int size = static_cast<int>(bootstrap.size);
  const int rank = static_cast<int>(bootstrap.rank);
  // Blocking whatever NCCL_COMM_BLOCKING says: every call here expects NCCL to
  // return done or failed, never ncclInProgress. Split children inherit it.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  check_nccl(ncclCommInitRankConfig(&comm, size, message.id, rank, &config),
             context + " (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")",
             "ncclCommInitRankConfig", nullptr);
  std::unique_ptr<Communicator> world(
      new Communicator(host, comm, options.device_id, "world", options.timeout_seconds));
  world->log(MESHRUN_LOG_DEBUG, "nccl: rank " + std::to_string(rank) + " of " +
                                    std::to_string(size) + " joined the world on CUDA device " +
                                    std::to_string(options.device_id));
  return world;
}

std::unique_ptr<Communicator> Communicator::split(int64_t color, int64_t key,
                                                  const std::string& name) {
  const std::string context = describe("split") + " into '" + name + "'";
  require_usable("split");
  if (color < 0 || color > INT_MAX) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + ": color " + std::to_string(color) +
                                              " is outside 0 .. " + std::to_string(INT_MAX));
  }
  if (key < INT_MIN || key > INT_MAX) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                context + ": key " + std::to_string(key) + " does not fit in an int");
  }
  DeviceGuard device_guard(device_, context);
  ncclComm_t child = nullptr;
  // A NULL config: the child inherits the parent's.
  check_nccl(ncclCommSplit(comm_, static_cast<int>(color), static_cast<int>(key), &child, nullptr),
             context, "ncclCommSplit", comm_);
  if (child == nullptr) {
    throw Error(MESHRUN_INTERNAL, context + ": ncclCommSplit returned no communicator");
  }
  return std::unique_ptr<Communicator>(
      new Communicator(*host_, child, device_, name, timeout_seconds_));
}

void Communicator::set_stream(cudaStream_t stream) {
  require_usable("set_stream");
#if CUDART_VERSION >= 12080
  // The special handles name the current device's default streams; NCCL and
  // the event record both resolve them on the communicator's device.
  if (stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread) {
    int device = 0;
    check_cuda(cudaStreamGetDevice(stream, &device), describe("set_stream"), "cudaStreamGetDevice");
    if (device != device_) {
      throw Error(MESHRUN_INVALID_ARGUMENT, describe("set_stream") + ": the stream is on CUDA " +
                                                "device " + std::to_string(device) +
                                                ", the communicator on device " +
                                                std::to_string(device_));
    }
  }
#endif
  stream_ = stream;
}

std::string Communicator::describe(const char* op) const {
  return std::string("nccl ") + op + " on communicator '" + name_ + "' (rank " +
         std::to_string(rank_) + " of " + std::to_string(size_) + ")";
}

void Communicator::log(int32_t level, const std::string& message) const {
  host_->log(host_->context, level, message.c_str());
}

std::optional<std::pair<int32_t, std::string>> Communicator::async_error() {
  if (aborted_) return std::pair{MESHRUN_UNAVAILABLE, abort_reason_};
  ncclResult_t state = ncclSuccess;
  const ncclResult_t result = ncclCommGetAsyncError(comm_, &state);
  if (result == ncclSuccess && (state == ncclSuccess || state == ncclInProgress)) {
    return std::nullopt;
  }
  const ncclResult_t failure = result != ncclSuccess ? result : state;
  const int32_t code =
      code_of(failure) == MESHRUN_UNAVAILABLE ? MESHRUN_UNAVAILABLE : MESHRUN_INTERNAL;
  abort_reason_ = "NCCL reported an asynchronous error: " + nccl_text(failure, comm_) +
                  "; the communicator was aborted";
  // Abort makes NCCL's kernels on the stream return, so the stream and the
  // other communicators' work behind it are not held forever.
  ncclCommAbort(comm_);
  aborted_ = true;
  log(MESHRUN_LOG_ERROR, describe("async") + ": " + abort_reason_);
  return std::pair{code, abort_reason_};
}

void Communicator::require_usable(const char* op) const {
  if (aborted_) throw Error(MESHRUN_UNAVAILABLE, describe(op) + ": " + abort_reason_);
}

Buffer Communicator::buffer(const DLTensor* tensor, const char* role, const char* op) const {
  const std::string context = describe(op) + ": " + role + " tensor";
  if (tensor == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, context + " is NULL");
  if (tensor->device.device_type != kDLCUDA) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                context + " is on DLPack device type " +
                    std::to_string(tensor->device.device_type) +
                    "; the nccl backend moves CUDA tensors (kDLCUDA = 2)");
  }
  if (tensor->device.device_id != device_) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                context + " is on CUDA device " + std::to_string(tensor->device.device_id) +
                    ", the communicator on device " + std::to_string(device_));
  }
  const auto type = nccl_type(tensor->dtype);
  if (!type) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                context + " has DLPack dtype (code " + std::to_string(tensor->dtype.code) +
                    ", bits " + std::to_string(tensor->dtype.bits) + ", lanes " +
                    std::to_string(tensor->dtype.lanes) +
                    "); the nccl backend moves float32, bfloat16, float16, int32 and int64");
  }
  if (tensor->ndim < 0 || (tensor->ndim > 0 && tensor->shape == nullptr)) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + " has ndim " + std::to_string(tensor->ndim) +
                                              (tensor->ndim > 0 ? " and a NULL shape" : ""));
  }
  const size_t max_count = std::numeric_limits<size_t>::max() / type->second;
  size_t count = 1;
  int64_t expected_stride = 1;
  for (int32_t dim = tensor->ndim - 1; dim >= 0; --dim) {
    const int64_t extent = tensor->shape[dim];
    if (extent < 0) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  context + " has a negative extent in dimension " + std::to_string(dim));
    }
    // A dimension of extent 1 is compact whatever its stride says (PyTorch
    // writes arbitrary strides there).
    if (tensor->strides != nullptr && extent != 1 && tensor->strides[dim] != expected_stride) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  context + " is not compact: stride " + std::to_string(tensor->strides[dim]) +
                      " in dimension " + std::to_string(dim) + ", row-major needs " +
                      std::to_string(expected_stride));
    }
    if (extent != 0 && count > max_count / static_cast<size_t>(extent)) {
      throw Error(MESHRUN_INVALID_ARGUMENT, context + " has more elements than memory can hold");
    }
    count *= static_cast<size_t>(extent);
    expected_stride *= extent;
  }
  if (tensor->data == nullptr && count > 0) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + " has NULL data");
  }
  Buffer buffer;
  buffer.data = static_cast<char*>(tensor->data) + tensor->byte_offset;
  buffer.count = count;
  buffer.type = type->first;
  buffer.element_bytes = type->second;
  return buffer;
}

void Communicator::require_peer(int64_t peer, const char* role, const char* op) const {
  if (peer < 0 || peer >= size_) {
    throw Error(MESHRUN_INVALID_ARGUMENT, describe(op) + ": " + role + " " + std::to_string(peer) +
                                              " is not a rank of the communicator (0 .. " +
                                              std::to_string(size_ - 1) + ")");
  }
}

template <class Body>
std::unique_ptr<Request> Communicator::launch(const char* op, Body&& body) {
  require_usable(op);
  const std::string context = describe(op);
  DeviceGuard device_guard(device_, context);
  cudaEvent_t event = nullptr;
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), context,
             "cudaEventCreateWithFlags");
  auto request = std::make_unique<Request>(*this, op, event);
  body(context);
  check_cuda(cudaEventRecord(event, stream_), context, "cudaEventRecord");
  return request;
}

std::unique_ptr<Request> Communicator::all_reduce(const DLTensor* send, DLTensor* recv,
                                                  int32_t op) {
  const char* name = "all_reduce";
  const Buffer in = buffer(send, "send", name);
  const Buffer out = buffer(recv, "recv", name);
  const std::string context = describe(name);
  require_same_dtype(in, out, context);
  if (in.count != out.count) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + ": send has " + std::to_string(in.count) +
                                              " elements, recv " + std::to_string(out.count));
  }
  if (in.data != out.data && overlap(in, out)) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context +
                                              ": send and recv overlap without being the "
                                              "same buffer (in place)");
  }
  const ncclRedOp_t reduction = nccl_op(op, context);
  return launch(name, [&](const std::string& where) {
    check_nccl(ncclAllReduce(in.data, out.data, in.count, in.type, reduction, comm_, stream_),
               where, "ncclAllReduce", comm_);
  });
}

std::unique_ptr<Request> Communicator::all_gather(const DLTensor* send, DLTensor* recv) {
  const char* name = "all_gather";
  const Buffer in = buffer(send, "send", name);
  const Buffer out = buffer(recv, "recv", name);
  const std::string context = describe(name);
  require_same_dtype(in, out, context);
  if (in.count > out.count / static_cast<size_t>(size_) ||
      in.count * static_cast<size_t>(size_) != out.count) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + ": recv has " + std::to_string(out.count) +
                                              " elements, not size " + std::to_string(size_) +
                                              " x send's " + std::to_string(in.count));
  }
  // NCCL's in-place form: this rank's input already sits in its chunk of recv.
  char* const own_chunk = out.data + static_cast<size_t>(rank_) * in.bytes();
  const bool input_first = in.data == out.data && in.data != own_chunk && in.count > 0;
  if (in.data != own_chunk && !input_first && overlap(in, out)) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                context + ": send overlaps recv other than at recv's start or at chunk " +
                    std::to_string(rank_) + " of recv");
  }
  return launch(name, [&](const std::string& where) {
    if (input_first) {
      // Chunk 0 of recv holds the input but receives rank 0's data: move the
      // input into this rank's chunk first (disjoint, as rank > 0 here).
      check_cuda(cudaMemcpyAsync(own_chunk, in.data, in.bytes(), cudaMemcpyDeviceToDevice, stream_),
                 where, "cudaMemcpyAsync");
    }
    const char* source = input_first ? own_chunk : in.data;
    check_nccl(ncclAllGather(source, out.data, in.count, in.type, comm_, stream_), where,
               "ncclAllGather", comm_);
  });
}

std::unique_ptr<Request> Communicator::reduce_scatter(const DLTensor* send, DLTensor* recv,
                                                      int32_t op) {
  const char* name = "reduce_scatter";
  const Buffer in = buffer(send, "send", name);
  const Buffer out = buffer(recv, "recv", name);
  const std::string context = describe(name);
  require_same_dtype(in, out, context);
  if (out.count > in.count / static_cast<size_t>(size_) ||
      out.count * static_cast<size_t>(size_) != in.count) {
    throw Error(MESHRUN_INVALID_ARGUMENT, context + ": send has " + std::to_string(in.count) +
                                              " elements, not size " + std::to_string(size_) +
                                              " x recv's " + std::to_string(out.count));
  }
  const ncclRedOp_t reduction = nccl_op(op, context);
  // NCCL's in-place form: the result lands in this rank's chunk of send.
  char* const own_chunk = in.data + static_cast<size_t>(rank_) * out.bytes();
  const bool result_first = out.data == in.data && out.data != own_chunk && out.count > 0;
  if (out.data != own_chunk && !result_first && overlap(in, out)) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                context + ": recv overlaps send other than at send's start or at chunk " +
                    std::to_string(rank_) + " of send");
  }
  return launch(name, [&](const std::string& where) {
    // recv is chunk 0 of send, which other ranks' reductions still read while
    // this one runs: reduce in place into this rank's chunk, then move the
    // result to the front (disjoint, as rank > 0 here).
    char* const target = result_first ? own_chunk : out.data;
    check_nccl(ncclReduceScatter(in.data, target, out.count, in.type, reduction, comm_, stream_),
               where, "ncclReduceScatter", comm_);
    if (result_first) {
      check_cuda(
          cudaMemcpyAsync(out.data, own_chunk, out.bytes(), cudaMemcpyDeviceToDevice, stream_),
          where, "cudaMemcpyAsync");
    }
  });
}

std::unique_ptr<Request> Communicator::broadcast(DLTensor* tensor, int64_t root) {
  const char* name = "broadcast";
  const Buffer data = buffer(tensor, "broadcast", name);
  require_peer(root, "root", name);
  return launch(name, [&](const std::string& where) {
    check_nccl(ncclBroadcast(data.data, data.data, data.count, data.type, static_cast<int>(root),
                             comm_, stream_),
               where, "ncclBroadcast", comm_);
  });
}

// NCCL matches sends and receives by order alone: a tag is accepted but must
// be non-negative, and a rank cannot pair with itself.
void Communicator::require_point_to_point(int64_t peer, int64_t tag, const char* name,
                                          const char* self_transfer) const {
  require_peer(peer, "peer", name);
  if (peer == rank_) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                describe(name) + ": " + self_transfer + " is not supported by the nccl backend");
  }
  if (tag < 0) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                describe(name) + ": tag " + std::to_string(tag) + " is negative");
  }
}

std::unique_ptr<Request> Communicator::send(const DLTensor* tensor, int64_t peer, int64_t tag) {
  const char* name = "send";
  const Buffer data = buffer(tensor, "send", name);
  require_point_to_point(peer, tag, name, "sending to oneself");
  return launch(name, [&](const std::string& where) {
    check_nccl(ncclSend(data.data, data.count, data.type, static_cast<int>(peer), comm_, stream_),
               where, "ncclSend", comm_);
  });
}

std::unique_ptr<Request> Communicator::recv(DLTensor* tensor, int64_t peer, int64_t tag) {
  const char* name = "recv";
  const Buffer data = buffer(tensor, "recv", name);
  require_point_to_point(peer, tag, name, "receiving from oneself");
  return launch(name, [&](const std::string& where) {
    check_nccl(ncclRecv(data.data, data.count, data.type, static_cast<int>(peer), comm_, stream_),
               where, "ncclRecv", comm_);
  });
}

std::unique_ptr<Request> Communicator::all_to_all(const DLTensor* send, const int64_t* send_counts,
                                                  DLTensor* recv, const int64_t* recv_counts) {
  const char* name = "all_to_all";
  const Buffer in = buffer(send, "send", name);
  const Buffer out = buffer(recv, "recv", name);
  const std::string context = describe(name);
  require_same_dtype(in, out, context);
  if (overlap(in, out)) throw Error(MESHRUN_INVALID_ARGUMENT, context + ": send and recv overlap");
  const auto offsets = [&](const int64_t* counts, const Buffer& tensor, const char* role) {
    if (counts == nullptr) {
      throw Error(MESHRUN_INVALID_ARGUMENT, context + ": " + role + "_counts is NULL");
    }
    std::vector<size_t> at(static_cast<size_t>(size_) + 1, 0);
    for (int64_t r = 0; r < size_; ++r) {
      if (counts[r] < 0) {
        throw Error(MESHRUN_INVALID_ARGUMENT,
                    context + ": " + role + "_counts[" + std::to_string(r) + "] is negative");
      }
      at[static_cast<size_t>(r) + 1] = at[static_cast<size_t>(r)] + static_cast<size_t>(counts[r]);
    }
    if (at.back() != tensor.count) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  context + ": " + role + " has " + std::to_string(tensor.count) +
                      " elements, its counts add up to " + std::to_string(at.back()));
    }
    return at;
  };
  const std::vector<size_t> send_at = offsets(send_counts, in, "send");
  const std::vector<size_t> recv_at = offsets(recv_counts, out, "recv");
  return launch(name, [&](const std::string& where) {
    check_nccl(ncclGroupStart(), where, "ncclGroupStart", comm_);
    for (int64_t r = 0; r < size_; ++r) {
      const auto peer = static_cast<size_t>(r);
      const size_t sending = send_at[peer + 1] - send_at[peer];
      const size_t receiving = recv_at[peer + 1] - recv_at[peer];
      if (sending > 0) {
        check_nccl(ncclSend(in.data + send_at[peer] * in.element_bytes, sending, in.type,
                            static_cast<int>(r), comm_, stream_),
                   where, "ncclSend", comm_);
      }
      if (receiving > 0) {
        check_nccl(ncclRecv(out.data + recv_at[peer] * out.element_bytes, receiving, out.type,
                            static_cast<int>(r), comm_, stream_),
                   where, "ncclRecv", comm_);
      }
    }
    check_nccl(ncclGroupEnd(), where, "ncclGroupEnd", comm_);
  });
}

std::unique_ptr<Request> Communicator::barrier() {
  return launch("barrier", [&](const std::string& where) {
    check_nccl(
        ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclInt32, ncclSum, comm_, stream_),
        where, "ncclAllReduce", comm_);
  });
}

}  // namespace meshrun::nccl
