// The nccl comm plugin's C boundary in one process: NULL handles, a missing
// or too-small bootstrap or options, and a one-rank world. These run on every
// machine that builds the plugin: without a GPU the world must fail with
// UNAVAILABLE and say why; with one, a one-rank world runs every operation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "errors.hpp"
#include "plugin/loader.hpp"

namespace {

// The plugin, loaded once and kept, with one instance.
struct Nccl {
  std::shared_ptr<meshrun::PluginLibrary> library =
      meshrun::PluginLoader::from_environment().load(meshrun::PluginKind::comm, "nccl");
  meshrun::PluginInstance instance{library};
  const meshrun_comm_api& api = *library->api().comm;
};

Nccl& nccl() {
  static Nccl loaded;
  return loaded;
}

// Releases `error` and returns its code and message.
std::pair<int32_t, std::string> take(meshrun_error* error) {
  REQUIRE(error != nullptr);
  std::pair<int32_t, std::string> result{error->code, error->message};
  meshrun_error_release(error);
  return result;
}

// A bootstrap for a job of one rank: broadcasting from rank 0 to itself
// leaves the bytes as they are.
meshrun_error* broadcast_to_self(void*, void*, size_t, int64_t) { return nullptr; }

const meshrun_bootstrap kOneRank{sizeof(meshrun_bootstrap), 0, 1, nullptr, &broadcast_to_self};
const meshrun_comm_options kOptions{sizeof(meshrun_comm_options), 60.0, 0, nullptr};

// `count` small integers (negative on odd indices) in `dtype`'s bytes.
std::vector<unsigned char> pattern(DLDataType dtype, int64_t count) {
  const size_t element = meshrun::dtype_bytes(dtype);
  const std::string name = meshrun::dtype_name(dtype);
  std::vector<unsigned char> bytes(static_cast<size_t>(count) * element);
  for (int64_t i = 0; i < count; ++i) {
    const float value = static_cast<float>(i % 2 == 1 ? -(i % 13) : i % 13);
    unsigned char* out = bytes.data() + static_cast<size_t>(i) * element;
    if (name == "float32") {
      std::memcpy(out, &value, element);
    } else if (name == "bfloat16") {
      const __nv_bfloat16 v = __float2bfloat16(value);
      std::memcpy(out, &v, element);
    } else if (name == "float16") {
      const __half v = __float2half(value);
      std::memcpy(out, &v, element);
    } else if (name == "int32") {
      const auto v = static_cast<int32_t>(value);
      std::memcpy(out, &v, element);
    } else {
      const auto v = static_cast<int64_t>(value);
      std::memcpy(out, &v, element);
    }
  }
  return bytes;
}

bool have_gpu() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
}

}  // namespace

TEST_CASE("the nccl table moves CUDA tensors and has the ABI 1.1 functions", "[nccl]") {
  CHECK(nccl().api.device_type == kDLCUDA);
  CHECK(nccl().api.struct_size >= MESHRUN_COMM_API_SIZE_1_1);
}

TEST_CASE("world without a bootstrap names the reason", "[nccl]") {
  meshrun_communicator* out = nullptr;
  const auto [code, message] =
      take(nccl().api.world(nccl().instance.handle(), nullptr, &kOptions, &out));
  CHECK(code == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(message, Catch::Contains("bootstrap is NULL"));
  CHECK(out == nullptr);
}

TEST_CASE("world refuses NULL and too-small arguments", "[nccl]") {
  const meshrun_comm_api& api = nccl().api;
  meshrun_plugin_instance* instance = nccl().instance.handle();
  meshrun_communicator* out = nullptr;
  CHECK(take(api.world(nullptr, &kOneRank, &kOptions, &out)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.world(instance, &kOneRank, nullptr, &out)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.world(instance, &kOneRank, &kOptions, nullptr)).first == MESHRUN_INVALID_ARGUMENT);

  meshrun_bootstrap small = kOneRank;
  small.struct_size = MESHRUN_STRUCT_SIZE(meshrun_bootstrap, context);
  CHECK(take(api.world(instance, &small, &kOptions, &out)).first == MESHRUN_INVALID_ARGUMENT);
  meshrun_comm_options small_options = kOptions;
  small_options.struct_size = MESHRUN_STRUCT_SIZE(meshrun_comm_options, timeout_seconds);
  CHECK(take(api.world(instance, &kOneRank, &small_options, &out)).first ==
        MESHRUN_INVALID_ARGUMENT);
  meshrun_bootstrap outside = kOneRank;
  outside.rank = 1;
  CHECK(take(api.world(instance, &outside, &kOptions, &out)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(out == nullptr);
}

TEST_CASE("NULL communicators and requests are refused, and destroyed quietly", "[nccl]") {
  const meshrun_comm_api& api = nccl().api;
  int64_t value = 0;
  int32_t done = 0;
  meshrun_communicator* child = nullptr;
  meshrun_request* request = nullptr;
  DLTensor tensor{};
  CHECK(take(api.rank(nullptr, &value)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.size(nullptr, &value)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.split(nullptr, 0, 0, "dp", &child)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.set_stream(nullptr, nullptr)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.all_reduce(nullptr, &tensor, &tensor, MESHRUN_REDUCE_SUM, &request)).first ==
        MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.all_gather(nullptr, &tensor, &tensor, &request)).first ==
        MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.reduce_scatter(nullptr, &tensor, &tensor, MESHRUN_REDUCE_SUM, &request)).first ==
        MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.broadcast(nullptr, &tensor, 0, &request)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.send(nullptr, &tensor, 0, 0, &request)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.recv(nullptr, &tensor, 0, 0, &request)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.barrier(nullptr, &request)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.wait(nullptr, 1.0)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(take(api.test(nullptr, &done)).first == MESHRUN_INVALID_ARGUMENT);
  CHECK(request == nullptr);
  api.communicator_destroy(nullptr);
  api.request_destroy(nullptr);
}

TEST_CASE("a one-rank world: UNAVAILABLE without a GPU, every operation with one", "[nccl]") {
  const meshrun_comm_api& api = nccl().api;
  meshrun_communicator* world = nullptr;
  meshrun_error* error = api.world(nccl().instance.handle(), &kOneRank, &kOptions, &world);
  if (!have_gpu()) {
    const auto [code, message] = take(error);
    CHECK(code == MESHRUN_UNAVAILABLE);
    CHECK_THAT(message, Catch::Contains("CUDA device"));
    CHECK(world == nullptr);
    return;
  }
  REQUIRE(error == nullptr);
  meshrun::Communicator communicator(nccl().library, world, "world");
  CHECK(communicator.rank() == 0);
  CHECK(communicator.size() == 1);

  // On one rank every operation copies its input, whatever the dtype and op.
  const int64_t count = 1000;
  for (DLDataType dtype :
       {meshrun::dtype_float32(), meshrun::dtype_bfloat16(), meshrun::dtype_float16(),
        meshrun::dtype_int32(), meshrun::dtype_int64()}) {
    INFO(meshrun::dtype_name(dtype));
    const std::vector<unsigned char> host = pattern(dtype, count);
    const size_t bytes = host.size();
    void* send = nullptr;
    void* recv = nullptr;
    REQUIRE(cudaMalloc(&send, bytes) == cudaSuccess);
    REQUIRE(cudaMalloc(&recv, bytes) == cudaSuccess);
    meshrun::FlatTensor in(send, dtype, count, {kDLCUDA, 0});
    meshrun::FlatTensor out(recv, dtype, count, {kDLCUDA, 0});
    const auto reset = [&] {
      REQUIRE(cudaMemcpy(send, host.data(), bytes, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemset(recv, 0, bytes) == cudaSuccess);
    };
    const auto expect_input_in = [&](void* where, const char* what) {
      std::vector<unsigned char> got(bytes);
      REQUIRE(cudaMemcpy(got.data(), where, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
      INFO(what);
      CHECK(got == host);
    };

    for (auto op : {meshrun::ReduceOp::sum, meshrun::ReduceOp::avg, meshrun::ReduceOp::max}) {
      reset();
      communicator.all_reduce(in.get(), out.get(), op).wait();
      expect_input_in(recv, "all_reduce");
      reset();
      communicator.all_reduce(in.get(), op).wait();
      expect_input_in(send, "all_reduce in place");
      reset();
      communicator.reduce_scatter(in.get(), out.get(), op).wait();
      expect_input_in(recv, "reduce_scatter");
    }
    reset();
    communicator.all_gather(in.get(), out.get()).wait();
    expect_input_in(recv, "all_gather");
    reset();
    communicator.broadcast(in.get(), 0).wait();
    expect_input_in(send, "broadcast");
    cudaFree(send);
    cudaFree(recv);
  }

  // Polled with test() on a stream of the caller's, and on a split.
  const std::vector<unsigned char> host = pattern(meshrun::dtype_float32(), count);
  void* data = nullptr;
  REQUIRE(cudaMalloc(&data, host.size()) == cudaSuccess);
  REQUIRE(cudaMemcpy(data, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  meshrun::FlatTensor tensor(data, meshrun::dtype_float32(), count, {kDLCUDA, 0});
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  communicator.set_stream(stream);
  meshrun::Communicator child = communicator.split(3, 0, "tp");
  CHECK(child.size() == 1);
  {
    meshrun::Request request = communicator.all_reduce(tensor.get(), meshrun::ReduceOp::sum);
    while (!request.test()) {
    }
    request.wait(0.0);
    child.barrier().wait(30.0);
  }
  communicator.barrier().wait();
  communicator.set_stream(nullptr);
  std::vector<unsigned char> got(host.size());
  REQUIRE(cudaMemcpy(got.data(), data, got.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(got == host);

  try {
    communicator.send(tensor.get(), 0, 0).wait();
    FAIL("a send to oneself was accepted");
  } catch (const meshrun::Error& e) {
    CHECK(e.code() == MESHRUN_INVALID_ARGUMENT);
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  cudaFree(data);
}
