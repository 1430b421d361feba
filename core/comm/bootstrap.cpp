#include "comm/bootstrap.hpp"

#include <cstring>
#include <exception>
#include <vector>

#include "errors.hpp"
#include "plugin/loader.hpp"

namespace meshrun {

CommBootstrap::CommBootstrap(Communicator& over)
    : bootstrap_{sizeof(meshrun_bootstrap), over.rank(), over.size(), &over, &broadcast} {}

meshrun_error* CommBootstrap::broadcast(void* context, void* data, size_t bytes, int64_t root) {
  const meshrun_host_services& host = host_services();
  try {
    auto& over = *static_cast<Communicator*>(context);
    std::vector<int32_t> words((bytes + sizeof(int32_t) - 1) / sizeof(int32_t), 0);
    std::memcpy(words.data(), data, bytes);
    FlatTensor tensor(words.data(), dtype_int32(), int64_t(words.size()));
    over.broadcast(tensor.get(), root).wait();
    std::memcpy(data, words.data(), bytes);
    return nullptr;
  } catch (const Error& e) {
    return host.make_error(host.context, e.code(), e.what());
  } catch (const std::exception& e) {
    return host.make_error(host.context, MESHRUN_INTERNAL, e.what());
  }
}

}  // namespace meshrun
