// make_cuda_device where the strategy was built without the CUDA toolkit.
#include "common/errors.hpp"
#include "device.hpp"

namespace meshrun::strategies {

std::unique_ptr<Device> make_cuda_device(int32_t, void*, void*) {
  throw strategies::Error(MESHRUN_UNIMPLEMENTED,
                          "setup: the comm backend moves CUDA tensors, but this strategy was "
                          "built without the CUDA toolkit (rebuild where nvcc is found)");
}

}  // namespace meshrun::strategies
