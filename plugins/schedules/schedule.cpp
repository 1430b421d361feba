// The pipeline schedule plugins (meshrun/schedule.h). The schedules differ
// by their facts (stages per rank, placement, split backward) and their
// generator: a row of kSchedules each, and a plugin table per row, which
// plugin_api (table.hpp) finds by the schedule's name.
#include <nlohmann/json.hpp>

#include <array>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <limits>
#include <string_view>
#include <utility>

#include "meshrun/plugin.hpp"
#include "schedules/generators.hpp"
#include "schedules/table.hpp"

namespace {

using meshrun::plugin::Error;
using meshrun::schedules::RankActions;
using meshrun::schedules::Sizes;

struct ScheduleFacts {
  std::string_view name;
  int32_t stages_per_rank;
  int32_t placement;
  int32_t splits_backward;
  RankActions (*generate)(const Sizes&);
  const char* description;
};

constexpr ScheduleFacts kSchedules[] = {
    {"gpipe", 1, MESHRUN_PLACEMENT_LOOP, 0, &meshrun::schedules::gpipe,
     "GPipe: every forward, then every backward; one stage per rank"},
    {"1f1b", 1, MESHRUN_PLACEMENT_LOOP, 0, &meshrun::schedules::one_f_one_b,
     "1F1B: warm-up forwards, then one forward one backward; one stage per rank"},
    {"interleaved_1f1b", 2, MESHRUN_PLACEMENT_LOOP, 0, &meshrun::schedules::interleaved_1f1b,
     "Interleaved 1F1B: 1F1B over several looped stages per rank, depth first"},
    {"looped_bfs", 2, MESHRUN_PLACEMENT_LOOP, 0, &meshrun::schedules::looped_bfs,
     "Looped BFS: breadth-first, every microbatch through one local stage before the next"},
    {"interleaved_zero_bubble", 2, MESHRUN_PLACEMENT_LOOP, 1,
     &meshrun::schedules::interleaved_zero_bubble,
     "Interleaved zero bubble (ZB1P): looped stages, backward split into input (I) and weight "
     "(W) parts, the Ws filling the bubbles"},
    {"zbv_zero_bubble", 2, MESHRUN_PLACEMENT_V, 1, &meshrun::schedules::zbv_zero_bubble,
     "ZBV zero bubble: two stages per rank in a V, backward split into I and W"},
    {"dualpipev", 2, MESHRUN_PLACEMENT_V, 1, &meshrun::schedules::dualpipev,
     "DualPipeV (DeepSeek-V3): two stages per rank in a V, the forward of one leg paired with "
     "the backward of the other, the drain split into I and W"},
};

// The sizes, checked against what every schedule needs: at least 1, and
// stage and microbatch indices that fit the int32 of an action.
Sizes checked_sizes(int64_t pp, int64_t stages_per_rank, int64_t microbatches) {
  const auto positive = [](const char* name, int64_t value) {
    if (value < 1) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  std::string(name) + " must be at least 1, got " + std::to_string(value));
    }
  };
  positive("pp", pp);
  positive("stages_per_rank", stages_per_rank);
  positive("microbatches", microbatches);
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (pp > kMax / stages_per_rank || microbatches > kMax) {
    throw Error(
        MESHRUN_INVALID_ARGUMENT,
        "pp * stages_per_rank and microbatches must each be at most " + std::to_string(kMax));
  }
  return {pp, stages_per_rank, microbatches};
}

// No schedule reads options yet; they must still be a JSON object, so that
// a typo in the config is not silently something else.
void check_options(const char* options_json) {
  if (options_json == nullptr) return;
  nlohmann::json options;
  try {
    options = nlohmann::json::parse(options_json);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(MESHRUN_INVALID_ARGUMENT, std::string("options_json is not JSON: ") + e.what());
  }
  if (!options.is_object()) {
    throw Error(MESHRUN_INVALID_ARGUMENT, "options_json must be a JSON object");
  }
}

// {"actions": [["0F0", ...], ...]}: action strings need no escaping.
std::string actions_json(const RankActions& ranks) {
  std::string text = "{\"actions\":[";
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    text += rank == 0 ? "[" : ",[";
    for (size_t i = 0; i < ranks[rank].size(); ++i) {
      text += i == 0 ? "\"" : ",\"";
      text += meshrun::schedule::format_action(ranks[rank][i]);
      text += '"';
    }
    text += ']';
  }
  text += "]}";
  return text;
}

// A schedule table's generate is one function per row, since the host passes
// it no row.
template <size_t Row>
meshrun_error* generate(meshrun_plugin_instance* instance, int64_t pp, int64_t stages_per_rank,
                        int64_t microbatches, const char* options_json, char** out_actions_json) {
  return meshrun::plugin::guard([&] {
    if (instance == nullptr || out_actions_json == nullptr) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "generate: instance and out_actions_json must not be NULL");
    }
    check_options(options_json);
    const Sizes sizes = checked_sizes(pp, stages_per_rank, microbatches);
    const std::string text = actions_json(kSchedules[Row].generate(sizes));
    const auto& host = reinterpret_cast<meshrun::plugin::HostServicesOnly*>(instance)->host();
    auto* copy = static_cast<char*>(host.allocate(host.context, text.size() + 1, 1));
    if (copy == nullptr) throw Error(MESHRUN_INTERNAL, "generate: out of memory");
    std::memcpy(copy, text.c_str(), text.size() + 1);
    *out_actions_json = copy;
  });
}

template <size_t Row>
constexpr meshrun_schedule_api kScheduleApi = {
    sizeof(meshrun_schedule_api),
    kSchedules[Row].stages_per_rank,
    kSchedules[Row].placement,
    kSchedules[Row].splits_backward,
    nullptr,
    &generate<Row>,
};

template <size_t Row>
constexpr meshrun_plugin_api kApi = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_SCHEDULE,
    kSchedules[Row].name.data(),
    MESHRUN_PLUGIN_VERSION,
    kSchedules[Row].description,
    &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>,
    &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>,
    nullptr,
    &kScheduleApi<Row>,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

template <size_t... Rows>
constexpr std::array<const meshrun_plugin_api*, sizeof...(Rows)> apis(
    std::index_sequence<Rows...>) {
  return {&kApi<Rows>...};
}

constexpr auto kApis = apis(std::make_index_sequence<std::size(kSchedules)>());

}  // namespace

const meshrun_plugin_api* meshrun::schedules::plugin_api(std::string_view name) {
  for (size_t row = 0; row < std::size(kSchedules); ++row) {
    if (kSchedules[row].name == name) return kApis[row];
  }
  return nullptr;
}
