// The plan's activation_checkpointing list, as the shipped models read it
// into the layers their stages recompute (common/description.hpp). The
// recomputation itself is checked per family, in test_llama_stage.cpp and
// test_gpt2_model.cpp.
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>

#include <catch2/catch.hpp>

#include "common/description.hpp"

using Catch::Matchers::Contains;
using meshrun::models::recomputed_layers;

TEST_CASE("the plan's activation_checkpointing names the recomputed layers", "[models][ac]") {
  const meshrun::models::ModelModules modules{{}, "model.layers.", {}};
  const auto read = [&](const std::string& list) {
    const std::string plan = R"({"units": [], "activation_checkpointing": )" + list + "}";
    return recomputed_layers(modules, 4, plan.c_str(), "llama");
  };
  CHECK(read("[]").empty());
  CHECK(recomputed_layers(modules, 4, nullptr, "llama").empty());
  CHECK(read(R"([{"module": "model.layers.0", "mode": "full"},
                 {"module": "model.layers.3", "mode": "full"}])") == std::set<int64_t>{0, 3});
  CHECK_THROWS_WITH(read(R"([{"module": "model.layers.1", "mode": "selective"}])"),
                    Contains("llama: ") && Contains("mode 'selective'"));
  CHECK_THROWS_WITH(read(R"([{"module": "model.layers.4", "mode": "full"}])"),
                    Contains("'model.layers.4' is not a layer's module"));
  CHECK_THROWS_WITH(read(R"([{"module": "model.norm", "mode": "full"}])"),
                    Contains("'model.norm' is not a layer's module"));
  CHECK_THROWS_AS(recomputed_layers(modules, 4, "{", "llama"), std::invalid_argument);
}
