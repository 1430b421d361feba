// Checks of a whole model (stage_fixture::OwnedModel) that the families'
// tests share: its parameter list, and its loss and every parameter's
// gradient against a naive double-precision reference loss
// (llama_reference.hpp, gpt2_reference.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "finite_differences.hpp"
#include "reference_math.hpp"
#include "stage_fixture.hpp"

namespace model_checks {

using NamedShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// The parameters are `expected` in order, indexed in order; those named
// layer_prefix + "N." are in unit N, the others in the unit `outside` gives.
inline void check_parameter_list(const std::vector<meshrun::models::ParameterView>& parameters,
                                 const NamedShapes& expected, const std::string& layer_prefix,
                                 const std::map<std::string, int64_t>& outside) {
  REQUIRE(parameters.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const std::string& name = expected[i].first;
    INFO(name);
    CHECK(parameters[i].name == name);
    CHECK(parameters[i].shape == expected[i].second);
    CHECK(parameters[i].index == int64_t(i));
    const bool in_layer = name.rfind(layer_prefix, 0) == 0;
    CHECK(parameters[i].unit ==
          (in_layer ? std::stoll(name.substr(layer_prefix.size())) : outside.at(name)));
  }
}

// Runs the model's forward and backward of `batch`, then compares each
// parameter's gradient (checked_entries of it) with central differences
// (eps 1e-6) of `reference(weights, batch)`, the mean loss of batch
// [batch_size, seq_len] in double precision from the weights by name:
// within abs_tol + rel_tol * |gradient|.
template <class Family, class Reference>
void check_gradients(stage_fixture::OwnedModel<Family>& model, const stage_fixture::Batch& batch,
                     int64_t batch_size, int64_t seq_len, Reference&& reference, double abs_tol,
                     double rel_tol) {
  model.forward(batch.tokens.data(), batch.targets.data(), batch_size, seq_len);
  model.backward();
  reference::Weights weights = reference::weights_of(model.parameters());
  for (const meshrun::models::ParameterView& view : model.parameters()) {
    reference::Vector& values = weights.at(view.name);
    std::vector<float> analytic;
    std::vector<double> numeric;
    for (const int64_t entry : finite_differences::checked_entries(view.numel)) {
      analytic.push_back(view.grad[entry]);
      numeric.push_back(finite_differences::central(values.data() + entry, 1, 1e-6,
                                                    [&] { return reference(weights, batch); })[0]);
    }
    INFO(analytic.size() << " of " << view.numel << " entries checked");
    finite_differences::require_close(view.name, analytic.data(), numeric, abs_tol, rel_tol);
  }
}

}  // namespace model_checks
