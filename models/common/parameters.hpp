// A model's parameter tensors as the shipped families describe them, and
// their initialization from a fully specified random stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshrun::models {

// One parameter tensor: its Hugging Face name and shape, its index among the
// model's parameters and its unit (decoder layer l is unit l, the root —
// embeddings, final norm, lm_head — one past the last layer), and where its
// values and gradient are while a stage computes with it.
struct ParameterView {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t index = 0;
  int64_t unit = 0;
  float* data = nullptr;
  float* grad = nullptr;
};

// Appends the parameter `name` with the next index, without storage.
void add_parameter(std::vector<ParameterView>& views, std::string name, std::vector<int64_t> shape,
                   int64_t unit);

// Fills `values` with parameters[index]'s normal(0, stddev) initial values
// for `seed`. The draws come from one splitmix64 + Box-Muller stream over the
// model's matrices (the parameters of two or more dimensions) in order, each
// element taking two uniform draws, so a seed gives the same weights with any
// standard library and any matrix can be made alone.
void init_normal(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                 double stddev, float* values);

}  // namespace meshrun::models
