// meshrun_write_safetensors (abi/include/meshrun/host.h, ABI 1.12): the
// Hugging Face weights file `meshrun train` exports, for a host's tensors.
#include <cstdint>
#include <string>
#include <vector>

#include "host_api.hpp"
#include "meshrun/host.h"
#include "state/safetensors.hpp"

meshrun_error* meshrun_write_safetensors(const char* path, int64_t num_tensors,
                                         const char* const* names, const int32_t* ndims,
                                         const int64_t* shapes, const DLTensor* values,
                                         int32_t bfloat16) {
  using meshrun::host_api::require;
  return meshrun::host_api::guarded(__func__, [&] {
    require(path, "path");
    require(values, "values");
    if (num_tensors < 0) throw meshrun::invalid_argument("num_tensors must be 0 or more");
    if (num_tensors > 0) {
      require(names, "names");
      require(ndims, "ndims");
      require(shapes, "shapes");
    }
    const bool flat_float32 = values->device.device_type == kDLCPU && values->ndim == 1 &&
                              values->dtype.code == kDLFloat && values->dtype.bits == 32 &&
                              values->dtype.lanes == 1 && values->shape != nullptr &&
                              (values->strides == nullptr || values->strides[0] == 1);
    if (!flat_float32) {
      throw meshrun::invalid_argument("values must be one flat float32 CPU tensor");
    }
    const auto* data = reinterpret_cast<const float*>(static_cast<const char*>(values->data) +
                                                      values->byte_offset);
    std::vector<meshrun::TensorToWrite> tensors;
    int64_t offset = 0;
    const int64_t* dims = shapes;
    for (int64_t t = 0; t < num_tensors; ++t) {
      require(names[t], "names[i]");
      if (ndims[t] < 0) throw meshrun::invalid_argument("ndims[i] must be 0 or more");
      std::vector<int64_t> shape(dims, dims + ndims[t]);
      dims += ndims[t];
      int64_t numel = 1;
      for (const int64_t extent : shape) {
        if (extent < 0)
          throw meshrun::invalid_argument(std::string(names[t]) + ": negative extent");
        numel *= extent;
      }
      tensors.push_back({names[t], shape, data + offset, numel});
      offset += numel;
    }
    if (offset != values->shape[0]) {
      throw meshrun::invalid_argument("values holds " + std::to_string(values->shape[0]) +
                                      " elements, the shapes " + std::to_string(offset));
    }
    meshrun::write_safetensors(path, tensors, bfloat16 != 0);
  });
}
