#include "common/setup_checks.hpp"

#include <algorithm>

#include "common/errors.hpp"

namespace meshrun::strategies {
namespace {

void check_parameter_layout(const meshrun_strategy_setup& setup) {
  if (setup.num_parameters < 0) invalid("setup: num_parameters is negative");
  if (setup.parameter_offsets == nullptr) invalid("setup: parameter_offsets is NULL");
  if (setup.num_parameters > 0 && setup.parameter_names == nullptr) {
    invalid("setup: parameter_names is NULL");
  }
  if (setup.parameter_offsets[0] != 0) invalid("setup: parameter_offsets[0] must be 0");
  for (int64_t p = 0; p < setup.num_parameters; ++p) {
    if (setup.parameter_names[p] == nullptr) {
      invalid("setup: parameter_names[" + std::to_string(p) + "] is NULL");
    }
    if (setup.parameter_offsets[p + 1] < setup.parameter_offsets[p]) {
      invalid("setup: parameter_offsets decrease at parameter '" +
              std::string(setup.parameter_names[p]) + "'");
    }
  }
}

}  // namespace

void check_setup(const meshrun_strategy_setup* setup, size_t minimum_size, const char* abi) {
  if (setup == nullptr) invalid("setup: setup is NULL");
  if (setup->struct_size < minimum_size) {
    invalid("setup: struct_size " + std::to_string(setup->struct_size) + " is too small (ABI " +
            abi + " needs " + std::to_string(minimum_size) + ")");
  }
  if (setup->comm == nullptr || setup->comm->struct_size < MESHRUN_COMM_API_SIZE_1_1) {
    invalid("setup: comm is NULL or lacks the ABI 1.1 communication functions");
  }
  if (setup->data_parallel == nullptr) invalid("setup: data_parallel is NULL");
  check_parameter_layout(*setup);
}

meshrun_strategy_setup setup_of(const meshrun_strategy_plan_input* input) {
  if (input == nullptr) invalid("plan_memory: input is NULL");
  if (!MESHRUN_HAS_FIELD(meshrun_strategy_plan_input, input, replicate_ranks)) {
    invalid("plan_memory: input->struct_size " + std::to_string(input->struct_size) +
            " is too small");
  }
  if (input->shard_ranks < 1 || input->replicate_ranks < 1) {
    invalid("plan_memory: shard_ranks and replicate_ranks must be at least 1");
  }
  meshrun_strategy_setup setup{};
  setup.struct_size = sizeof(setup);
  setup.num_parameters = input->num_parameters;
  setup.parameter_offsets = input->parameter_offsets;
  setup.parameter_names = input->parameter_names;
  setup.options_json = input->options_json;
  setup.num_units = input->num_units;
  setup.root_unit = input->root_unit;
  setup.parameter_units = input->parameter_units;
  setup.parameter_rows = input->parameter_rows;
  check_parameter_layout(setup);
  return setup;
}

void check_flat_float32(const DLTensor& tensor, const std::string& what, int64_t numel,
                        int32_t device_type, bool data_may_be_null) {
  if (tensor.dtype.code != kDLFloat || tensor.dtype.bits != 32 || tensor.dtype.lanes != 1) {
    invalid(what + " must be float32");
  }
  if (tensor.ndim != 1 || tensor.shape == nullptr) invalid(what + " must be one-dimensional");
  if (tensor.shape[0] != numel) {
    invalid(what + " has " + std::to_string(tensor.shape[0]) +
            " elements but the parameter offsets end at " + std::to_string(numel));
  }
  if (tensor.strides != nullptr && tensor.strides[0] != 1) invalid(what + " must be contiguous");
  if (tensor.data == nullptr && numel > 0 && !data_may_be_null) invalid(what + " data is NULL");
  if (tensor.device.device_type != device_type) {
    invalid(what + " is on device type " + std::to_string(tensor.device.device_type) +
            " but the comm backend moves device type " + std::to_string(device_type));
  }
}

size_t first_parameter_of_range(const std::vector<int64_t>& offsets, int64_t begin, int64_t end) {
  const int64_t numel = offsets.back();
  // Appended piece by piece: GCC 12 at -O3 takes "[" + std::to_string(...)
  // for an overlapping copy (a false -Wrestrict).
  std::string range = "[";
  range += std::to_string(begin);
  range += ", ";
  range += std::to_string(end);
  range += ')';
  if (begin < 0 || end > numel || begin > end) {
    throw Error(MESHRUN_OUT_OF_RANGE, "gradients_ready range " + range + " is not within [0, " +
                                          std::to_string(numel) + ")");
  }
  // Parameters are found by their first element; the range must start and
  // end on parameter boundaries.
  const auto p = static_cast<size_t>(std::lower_bound(offsets.begin(), offsets.end(), begin) -
                                     offsets.begin());
  if (offsets[p] != begin || !std::binary_search(offsets.begin(), offsets.end(), end)) {
    invalid("gradients_ready range " + range + " does not cover whole parameters");
  }
  return p;
}

}  // namespace meshrun::strategies
