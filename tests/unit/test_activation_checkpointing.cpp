// The plan's activation_checkpointing list, as the shipped models read it
// into the layers their stages checkpoint (common/description.hpp). The
// recomputation itself is checked per family, in test_llama_stage.cpp and
// test_gpt2_model.cpp.
#include <stdexcept>
#include <string>

#include <catch2/catch.hpp>

#include "common/description.hpp"

using Catch::Matchers::Contains;
using meshrun::models::checkpointed_layers;
using meshrun::models::Checkpointing;
using meshrun::models::Recomputation;

TEST_CASE("the plan's activation_checkpointing names the checkpointed layers", "[models][ac]") {
  const meshrun::models::ModelModules modules{{}, "model.layers.", {}};
  const auto read = [&](const std::string& list) {
    const std::string plan = R"({"units": [], "activation_checkpointing": )" + list + "}";
    return checkpointed_layers(modules, 4, plan.c_str(), "llama");
  };
  CHECK(read("[]").empty());
  CHECK(checkpointed_layers(modules, 4, nullptr, "llama").empty());
  CHECK(read(R"([{"module": "model.layers.0", "mode": "full"},
                 {"module": "model.layers.3", "mode": "selective"}])") ==
        Checkpointing{{0, Recomputation::full}, {3, Recomputation::selective}});
  CHECK_THROWS_WITH(read(R"([{"module": "model.layers.1", "mode": "some"}])"),
                    Contains("llama: ") && Contains("mode 'some'"));
  CHECK_THROWS_WITH(read(R"([{"module": "model.layers.4", "mode": "full"}])"),
                    Contains("'model.layers.4' is not a layer's module"));
  CHECK_THROWS_WITH(read(R"([{"module": "model.norm", "mode": "full"}])"),
                    Contains("'model.norm' is not a layer's module"));
  CHECK_THROWS_AS(checkpointed_layers(modules, 4, "{", "llama"), std::invalid_argument);
}
