// The nccl comm backend on real GPUs, run by ctest through mpirun (2 ranks):
// the world is bootstrapped through the mpi backend (rank 0's NCCL unique id
// travels in an mpi broadcast), then every operation runs on cudaMalloc'd
// buffers and is checked against results computed locally.
//
// Without a usable CUDA device, or with fewer devices on this node than ranks
// on it (NCCL refuses two ranks of one communicator on one device), it exits
// 77, which ctest reports as skipped, and says why, before touching any
// communicator.
//
// Tolerances: NCCL reduces float16 and bfloat16 in their own precision, and
// AVG multiplies each input by 1/size before summing. The inputs are small
// integers, so sums are exact for 2 ranks; for larger jobs each of the
// log2(size)+1 roundings costs at most 2^-9 (bfloat16) or 2^-12 (float16)
// relative, which 1e-2 and 2e-3 cover. float32 gets 1e-6; integers are exact,
// AVG truncating toward zero.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/bootstrap.hpp"
#include "comm/comm.hpp"
#include "errors.hpp"
#include "plugin/loader.hpp"
#include "usable_devices.hpp"

namespace {

constexpr double kTimeoutSeconds = 120.0;

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::atoi(value) : fallback;
}

// Checks made by this rank; failures are printed as they happen.
class Checks {
 public:
  explicit Checks(int rank) : rank_(rank) {}
  void expect(bool ok, const std::string& what) {
    ++count_;
    if (ok) return;
    ++failures_;
    std::fprintf(stderr, "rank %d: FAIL %s\n", rank_, what.c_str());
  }
  int failures() const { return failures_; }
  int count() const { return count_; }

 private:
  int rank_;
  int count_ = 0;
  int failures_ = 0;
};

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// Device memory for `count` elements of `dtype`, with host-side conversion
// from and to doubles.
class DeviceTensor {
  enum class Kind { float32, bfloat16, float16, int32, int64 };

 public:
  DeviceTensor(DLDataType dtype, size_t count, int device)
      : dtype_(dtype),
        kind_(kind_of(dtype)),
        count_(count),
        bytes_(count * meshrun::dtype_bytes(dtype)) {
    check_cuda(cudaMalloc(&data_, bytes_ == 0 ? 1 : bytes_), "cudaMalloc");
    view_ = std::make_unique<meshrun::FlatTensor>(data_, dtype_, static_cast<int64_t>(count_),
                                                  DLDevice{kDLCUDA, device});
  }
  ~DeviceTensor() { cudaFree(data_); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  DLTensor& get() { return view_->get(); }
  // A view of `count` elements starting at element `first`.
  meshrun::FlatTensor slice(size_t first, size_t count) const {
    return meshrun::FlatTensor(static_cast<char*>(data_) + first * meshrun::dtype_bytes(dtype_),
                               dtype_, static_cast<int64_t>(count), view_->get().device);
  }

  void upload(const std::vector<double>& values) {
    std::vector<unsigned char> host(bytes_);
    for (size_t i = 0; i < count_; ++i) encode(values[i], host.data() + i * element_bytes());
    check_cuda(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice), "upload");
    // A copy from pageable memory may return before its DMA ends, and the
    // operations may run on a stream that does not wait for the default one.
    check_cuda(cudaDeviceSynchronize(), "upload");
  }
  std::vector<double> download() const {
    std::vector<unsigned char> host(bytes_);
    check_cuda(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), "download");
    std::vector<double> values(count_);
    for (size_t i = 0; i < count_; ++i) values[i] = decode(host.data() + i * element_bytes());
    return values;
  }

 private:
  size_t element_bytes() const { return meshrun::dtype_bytes(dtype_); }

  void encode(double value, unsigned char* out) const {
    switch (kind_) {
      case Kind::float32:
        store(static_cast<float>(value), out);
        break;
      case Kind::bfloat16:
        store(__float2bfloat16(static_cast<float>(value)), out);
        break;
      case Kind::float16:
        store(__float2half(static_cast<float>(value)), out);
        break;
      case Kind::int32:
        store(static_cast<int32_t>(value), out);
        break;
      case Kind::int64:
        store(static_cast<int64_t>(value), out);
        break;
    }
  }
  double decode(const unsigned char* in) const {
    switch (kind_) {
      case Kind::float32:
        return load<float>(in);
      case Kind::bfloat16:
        return __bfloat162float(load<__nv_bfloat16>(in));
      case Kind::float16:
        return __half2float(load<__half>(in));
      case Kind::int32:
        return load<int32_t>(in);
      case Kind::int64:
        return static_cast<double>(load<int64_t>(in));
    }
    return 0.0;
  }
  template <class T>
  static void store(T value, unsigned char* out) {
    std::memcpy(out, &value, sizeof value);
  }
  template <class T>
  static T load(const unsigned char* in) {
    T value;
    std::memcpy(&value, in, sizeof value);
    return value;
  }
  static Kind kind_of(DLDataType dtype) {
    const std::string name = meshrun::dtype_name(dtype);
    if (name == "float32") return Kind::float32;
    if (name == "bfloat16") return Kind::bfloat16;
    if (name == "float16") return Kind::float16;
    if (name == "int32") return Kind::int32;
    if (name == "int64") return Kind::int64;
    throw std::runtime_error("no host conversion for " + name);
  }

  DLDataType dtype_;
  Kind kind_;
  size_t count_;
  size_t bytes_;
  void* data_ = nullptr;
  std::unique_ptr<meshrun::FlatTensor> view_;
};

const std::vector<DLDataType> kDtypes = {meshrun::dtype_float32(), meshrun::dtype_bfloat16(),
                                         meshrun::dtype_float16(), meshrun::dtype_int32(),
                                         meshrun::dtype_int64()};

bool is_integer(DLDataType dtype) { return dtype.code == kDLInt; }

double tolerance(DLDataType dtype) {
  const std::string name = meshrun::dtype_name(dtype);
  if (name == "bfloat16") return 1e-2;
  if (name == "float16") return 2e-3;
  if (name == "float32") return 1e-6;
  return 0.0;
}

// Element i of rank r's input: small integers, negative on odd i, so that
// every dtype holds them exactly and integer AVG exercises truncation.
double input(int64_t rank, size_t i) {
  const double magnitude = static_cast<double>((rank + 1) * static_cast<int64_t>(i % 11 + 1));
  return i % 2 == 1 ? -magnitude : magnitude;
}

double reduce(meshrun::ReduceOp op, DLDataType dtype, int64_t size, size_t i) {
  double sum = 0.0;
  double max = input(0, i);
  for (int64_t r = 0; r < size; ++r) {
    sum += input(r, i);
    max = std::max(max, input(r, i));
  }
  switch (op) {
    case meshrun::ReduceOp::sum:
      return sum;
    case meshrun::ReduceOp::max:
      return max;
    case meshrun::ReduceOp::avg:
      return is_integer(dtype) ? std::trunc(sum / static_cast<double>(size))
                               : sum / static_cast<double>(size);
  }
  return 0.0;
}

const char* op_name(meshrun::ReduceOp op) {
  switch (op) {
    case meshrun::ReduceOp::sum:
      return "sum";
    case meshrun::ReduceOp::avg:
      return "avg";
    case meshrun::ReduceOp::max:
      return "max";
  }
  return "?";
}

// Compares `got` with `expected(i)` element by element; reports the first
// mismatch only.
template <class Expected>
void expect_values(Checks& checks, const std::vector<double>& got, DLDataType dtype,
                   Expected&& expected, const std::string& what) {
  const double tol = tolerance(dtype);
  for (size_t i = 0; i < got.size(); ++i) {
    const double want = expected(i);
    if (std::fabs(got[i] - want) > tol * std::max(1.0, std::fabs(want))) {
      checks.expect(false, what + ": element " + std::to_string(i) + " is " +
                               std::to_string(got[i]) + ", expected " + std::to_string(want));
      return;
    }
  }
  checks.expect(true, what);
}

// Expects `body` to throw meshrun::Error with `code`.
template <class Body>
void expect_error(Checks& checks, int32_t code, const std::string& what, Body&& body) {
  try {
    body();
    checks.expect(false, what + ": no error");
  } catch (const meshrun::Error& e) {
    checks.expect(e.code() == code, what + ": code " + std::to_string(e.code()) + ": " + e.what());
  }
}

constexpr size_t kCounts[] = {1, 1031, 262147};
constexpr meshrun::ReduceOp kOps[] = {meshrun::ReduceOp::sum, meshrun::ReduceOp::avg,
                                      meshrun::ReduceOp::max};

void test_all_reduce(Checks& checks, meshrun::Communicator& comm, int device) {
  for (DLDataType dtype : kDtypes) {
    for (size_t count : kCounts) {
      for (meshrun::ReduceOp op : kOps) {
        const std::string what = "all_reduce " + std::string(op_name(op)) + " " +
                                 meshrun::dtype_name(dtype) + " x" + std::to_string(count);
        std::vector<double> mine(count);
        for (size_t i = 0; i < count; ++i) mine[i] = input(comm.rank(), i);
        const auto expected = [&](size_t i) { return reduce(op, dtype, comm.size(), i); };

        DeviceTensor send(dtype, count, device);
        DeviceTensor recv(dtype, count, device);
        send.upload(mine);
        comm.all_reduce(send.get(), recv.get(), op).wait();
        expect_values(checks, recv.download(), dtype, expected, what);

        send.upload(mine);
        comm.all_reduce(send.get(), op).wait();
        expect_values(checks, send.download(), dtype, expected, what + " in place");
      }
    }
  }
}

void test_all_gather(Checks& checks, meshrun::Communicator& comm, int device) {
  const auto size = static_cast<size_t>(comm.size());
  const auto rank = static_cast<size_t>(comm.rank());
  for (DLDataType dtype : kDtypes) {
    for (size_t count : kCounts) {
      const std::string what =
          "all_gather " + meshrun::dtype_name(dtype) + " x" + std::to_string(count);
      std::vector<double> mine(count);
      for (size_t i = 0; i < count; ++i) mine[i] = input(comm.rank(), i);
      const auto expected = [&](size_t i) {
        return input(static_cast<int64_t>(i / count), i % count);
      };

      DeviceTensor send(dtype, count, device);
      DeviceTensor recv(dtype, count * size, device);
      send.upload(mine);
      comm.all_gather(send.get(), recv.get()).wait();
      expect_values(checks, recv.download(), dtype, expected, what);

      // In place, input at the front of recv.
      std::vector<double> front(count * size, 0.0);
      std::copy(mine.begin(), mine.end(), front.begin());
      recv.upload(front);
      meshrun::FlatTensor at_front = recv.slice(0, count);
      comm.all_gather(at_front.get(), recv.get()).wait();
      expect_values(checks, recv.download(), dtype, expected, what + " in place (front)");

      // In place, NCCL's layout: input already at this rank's chunk.
      std::vector<double> own(count * size, 0.0);
      std::copy(mine.begin(), mine.end(), own.begin() + static_cast<std::ptrdiff_t>(rank * count));
      recv.upload(own);
      meshrun::FlatTensor at_own = recv.slice(rank * count, count);
      comm.all_gather(at_own.get(), recv.get()).wait();
      expect_values(checks, recv.download(), dtype, expected, what + " in place (own chunk)");
    }
  }
}

void test_reduce_scatter(Checks& checks, meshrun::Communicator& comm, int device) {
  const auto size = static_cast<size_t>(comm.size());
  const auto rank = static_cast<size_t>(comm.rank());
  for (DLDataType dtype : kDtypes) {
    for (size_t count : kCounts) {
      for (meshrun::ReduceOp op : kOps) {
        const std::string what = "reduce_scatter " + std::string(op_name(op)) + " " +
                                 meshrun::dtype_name(dtype) + " x" + std::to_string(count);
        std::vector<double> mine(count * size);
        for (size_t i = 0; i < mine.size(); ++i) mine[i] = input(comm.rank(), i);
        const auto expected = [&](size_t i) {
          return reduce(op, dtype, comm.size(), rank * count + i);
        };

        DeviceTensor send(dtype, count * size, device);
        DeviceTensor recv(dtype, count, device);
        send.upload(mine);
        comm.reduce_scatter(send.get(), recv.get(), op).wait();
        expect_values(checks, recv.download(), dtype, expected, what);

        send.upload(mine);
        meshrun::FlatTensor front = send.slice(0, count);
        comm.reduce_scatter(send.get(), front.get(), op).wait();
        std::vector<double> got = send.download();
        got.resize(count);
        expect_values(checks, got, dtype, expected, what + " in place (front)");

        send.upload(mine);
        meshrun::FlatTensor own = send.slice(rank * count, count);
        comm.reduce_scatter(send.get(), own.get(), op).wait();
        got = send.download();
        got.erase(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(rank * count));
        got.resize(count);
        expect_values(checks, got, dtype, expected, what + " in place (own chunk)");
      }
    }
  }
}

void test_broadcast(Checks& checks, meshrun::Communicator& comm, int device) {
  for (DLDataType dtype : kDtypes) {
    for (int64_t root : {int64_t{0}, comm.size() - 1}) {
      const size_t count = 1031;
      const std::string what =
          "broadcast " + meshrun::dtype_name(dtype) + " from root " + std::to_string(root);
      std::vector<double> mine(count);
      for (size_t i = 0; i < count; ++i) mine[i] = input(comm.rank(), i);
      DeviceTensor tensor(dtype, count, device);
      tensor.upload(mine);
      comm.broadcast(tensor.get(), root).wait();
      expect_values(
          checks, tensor.download(), dtype, [&](size_t i) { return input(root, i); }, what);
    }
  }
}

// Ring exchange (each rank sends to the next and receives from the previous)
// ordered so that no two ranks both send first to each other: NCCL runs a
// communicator's operations in order and a send waits for its recv.
void test_send_recv(Checks& checks, meshrun::Communicator& comm, int device) {
  const int64_t next = (comm.rank() + 1) % comm.size();
  const int64_t previous = (comm.rank() + comm.size() - 1) % comm.size();
  for (DLDataType dtype : kDtypes) {
    for (size_t count : kCounts) {
      const std::string what =
          "send/recv ring " + meshrun::dtype_name(dtype) + " x" + std::to_string(count);
      std::vector<double> mine(count);
      for (size_t i = 0; i < count; ++i) mine[i] = input(comm.rank(), i);
      DeviceTensor out(dtype, count, device);
      DeviceTensor in(dtype, count, device);
      out.upload(mine);
      const int64_t tag = 7;
      meshrun::Request sent;
      meshrun::Request received;
      if (comm.rank() % 2 == 0) {
        sent = comm.send(out.get(), next, tag);
        received = comm.recv(in.get(), previous, tag);
      } else {
        received = comm.recv(in.get(), previous, tag);
        sent = comm.send(out.get(), next, tag);
      }
      // Polls one request with test() before waiting, as an overlapping
      // caller would.
      while (!received.test()) {
      }
      received.wait();
      sent.wait();
      expect_values(
          checks, in.download(), dtype, [&](size_t i) { return input(previous, i); }, what);
    }
  }

  // A pipeline chain: rank 0 starts, every other rank receives from its
  // predecessor, adds its rank and passes it on.
  const size_t count = 4099;
  DeviceTensor stage(meshrun::dtype_float32(), count, device);
  if (comm.rank() == 0) {
    std::vector<double> zeros(count, 0.0);
    stage.upload(zeros);
  } else {
    comm.recv(stage.get(), comm.rank() - 1, /*tag=*/comm.rank()).wait();
    std::vector<double> values = stage.download();
    for (double& v : values) v += static_cast<double>(comm.rank());
    stage.upload(values);
  }
  if (comm.rank() + 1 < comm.size())
    comm.send(stage.get(), comm.rank() + 1, comm.rank() + 1).wait();
  const double want = static_cast<double>(comm.rank() * (comm.rank() + 1) / 2);
  expect_values(
      checks, stage.download(), meshrun::dtype_float32(), [&](size_t) { return want; },
      "send/recv chain");
}

void test_split(Checks& checks, meshrun::Communicator& world, int device) {
  // Every rank in one group, ordered backwards by key.
  meshrun::Communicator reversed = world.split(0, -world.rank(), "reversed");
  checks.expect(reversed.size() == world.size(), "split reversed: size");
  checks.expect(reversed.rank() == world.size() - 1 - world.rank(), "split reversed: rank");

  // Even and odd ranks apart: an all_reduce sums over the group only.
  meshrun::Communicator parity = world.split(world.rank() % 2, world.rank(), "parity");
  const int64_t members = (world.size() - world.rank() % 2 + 1) / 2;
  checks.expect(parity.size() == members, "split parity: size");
  checks.expect(parity.rank() == world.rank() / 2, "split parity: rank");
  DeviceTensor tensor(meshrun::dtype_int64(), 1, device);
  tensor.upload({static_cast<double>(world.rank())});
  parity.all_reduce(tensor.get(), meshrun::ReduceOp::sum).wait();
  double want = 0.0;
  for (int64_t r = world.rank() % 2; r < world.size(); r += 2) want += static_cast<double>(r);
  expect_values(
      checks, tensor.download(), meshrun::dtype_int64(), [&](size_t) { return want; },
      "split parity: all_reduce");
}

void test_stream_and_barrier(Checks& checks, meshrun::Communicator& comm, int device) {
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  comm.set_stream(stream);
  DeviceTensor tensor(meshrun::dtype_float32(), 1031, device);
  std::vector<double> mine(1031);
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = input(comm.rank(), i);
  tensor.upload(mine);
  comm.all_reduce(tensor.get(), meshrun::ReduceOp::sum).wait();
  expect_values(
      checks, tensor.download(), meshrun::dtype_float32(),
      [&](size_t i) {
        return reduce(meshrun::ReduceOp::sum, meshrun::dtype_float32(), comm.size(), i);
      },
      "all_reduce on a stream set with set_stream");
  comm.barrier().wait();
  comm.set_stream(nullptr);
  check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
  comm.barrier().wait();
  checks.expect(true, "barrier");
}

// Refusals that need no peer, so a rank makes them alone.
void test_refusals(Checks& checks, meshrun::Communicator& comm, meshrun::CommBackend& nccl,
                   int device) {
  std::vector<float> host(16);
  meshrun::FlatTensor cpu(host.data(), meshrun::dtype_float32(), 16);
  expect_error(checks, MESHRUN_INVALID_ARGUMENT, "a CPU tensor",
               [&] { comm.all_reduce(cpu.get(), meshrun::ReduceOp::sum).wait(); });
  DeviceTensor f32(meshrun::dtype_float32(), 16, device);
  DeviceTensor bf16(meshrun::dtype_bfloat16(), 16, device);
  expect_error(checks, MESHRUN_INVALID_ARGUMENT, "dtypes that differ",
               [&] { comm.all_reduce(f32.get(), bf16.get(), meshrun::ReduceOp::sum).wait(); });
  expect_error(checks, MESHRUN_INVALID_ARGUMENT, "a peer out of range",
               [&] { comm.send(f32.get(), comm.size(), 0).wait(); });
  expect_error(checks, MESHRUN_INVALID_ARGUMENT, "a send to oneself",
               [&] { comm.send(f32.get(), comm.rank(), 0).wait(); });
  expect_error(checks, MESHRUN_INVALID_ARGUMENT, "a root out of range",
               [&] { comm.broadcast(f32.get(), -1).wait(); });
  expect_error(checks, MESHRUN_INVALID_ARGUMENT, "a world without a bootstrap",
               [&] { nccl.world(kTimeoutSeconds, device, nullptr); });
}

}  // namespace

int main() {
  const std::optional<int> usable = usable_cuda_devices();
  if (!usable) return kSkip;
  const int devices = *usable;
  // Open MPI's mpirun tells each rank its place on the node.
  const int local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  const int local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  if (devices < local_size) {
    std::printf("SKIP: %d ranks on this node but %d CUDA device(s); NCCL needs a device per rank\n",
                local_size, devices);
    return kSkip;
  }
  const int device = local_rank % devices;

  try {
    const meshrun::PluginLoader loader = meshrun::PluginLoader::from_environment();
    meshrun::CommBackend mpi(loader, "mpi");
    meshrun::Communicator cpu_world = mpi.world(kTimeoutSeconds);
    const meshrun::CommBootstrap bootstrap(cpu_world);
    Checks checks(static_cast<int>(cpu_world.rank()));
    int failures = 0;
    {
      meshrun::CommBackend nccl(loader, "nccl");
      meshrun::Communicator world = nccl.world(kTimeoutSeconds, device, bootstrap.get());
      checks.expect(world.rank() == cpu_world.rank() && world.size() == cpu_world.size(),
                    "nccl world has the mpi world's rank and size");
      test_all_reduce(checks, world, device);
      test_all_gather(checks, world, device);
      test_reduce_scatter(checks, world, device);
      test_broadcast(checks, world, device);
      test_send_recv(checks, world, device);
      test_split(checks, world, device);
      test_stream_and_barrier(checks, world, device);
      test_refusals(checks, world, nccl, device);
      failures = checks.failures();
    }
    std::printf("rank %lld: %d of %d checks passed on CUDA device %d\n",
                static_cast<long long>(cpu_world.rank()), checks.count() - failures, checks.count(),
                device);
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
