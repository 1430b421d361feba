// meshrun schedule NAME --pp P --microbatches M [--stages-per-rank V] [--json] [--svg FILE]
//                       [--costs F=1,B=1,I=0.5,W=0.5]
// meshrun schedule --csv FILE --pp P --microbatches M [--stages-per-rank V] ...
//
// Generates a schedule plugin's schedule (or reads a CSV one), adds the
// communication, validates it, simulates it for the costs and prints the
// action grid and the figures, or one JSON object; --svg draws the timeline.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "plugin/loader.hpp"
#include "schedule/schedule.hpp"
#include "simulate/simulate.hpp"
#include "simulate/svg.hpp"

namespace meshrun::cli {
namespace {

constexpr const char* kScheduleUsage =
    "usage: meshrun schedule NAME --pp P --microbatches M [--stages-per-rank V] [--json]\n"
    "                        [--svg FILE] [--costs F=1,B=1,I=0.5,W=0.5,send=0,recv=0]\n"
    "       meshrun schedule --csv FILE --pp P --microbatches M [--stages-per-rank V] ...";

// Above this many (stage, microbatch) pairs the schedule and its simulation
// take gigabytes; 16 times the largest documented case (pp 64, v 2, m 1024).
constexpr int64_t kMaxStageMicrobatches = int64_t{1} << 21;

struct Request {
  std::optional<std::string> name;
  std::optional<std::string> csv;
  int64_t pp = 1;
  int64_t microbatches = 1;
  std::optional<int64_t> stages_per_rank;
  schedule::Costs costs;
};

int64_t required_int(const ParsedArgs& parsed, const char* option, int64_t maximum) {
  const auto value = parsed.value(option);
  if (!value) {
    throw invalid_argument(fmt::format(
        "meshrun schedule: --{} is required; usage: meshrun schedule NAME --pp P --microbatches M",
        option));
  }
  return parse_int_option(option, *value, 1, maximum);
}

Request request_of(const ParsedArgs& parsed) {
  if (!parsed.overrides.empty() || parsed.positionals.size() > 1) {
    const std::string extra =
        parsed.overrides.empty() ? parsed.positionals[1] : parsed.overrides.front();
    throw invalid_argument("meshrun schedule: unexpected argument '" + extra +
                           "'; give one schedule NAME");
  }
  Request request;
  if (!parsed.positionals.empty()) request.name = parsed.positionals[0];
  request.csv = parsed.value("csv");
  if (request.name.has_value() == request.csv.has_value()) {
    throw invalid_argument(
        "meshrun schedule: give a schedule NAME or --csv FILE (one of them); see meshrun "
        "plugins --kind schedule");
  }
  request.pp = required_int(parsed, "pp", 4096);
  request.microbatches = required_int(parsed, "microbatches", 1 << 20);
  if (const auto v = parsed.value("stages-per-rank")) {
    request.stages_per_rank = parse_int_option("stages-per-rank", *v, 1, 64);
  }
  if (const auto costs = parsed.value("costs")) {
    try {
      request.costs = schedule::parse_costs(*costs);
    } catch (const Error& error) {
      throw Error(error.code(), std::string("--costs: ") + error.what());
    }
  }
  return request;
}

void check_size(const Request& request, int64_t stages_per_rank) {
  const int64_t pairs = request.pp * stages_per_rank * request.microbatches;
  if (pairs > kMaxStageMicrobatches) {
    throw invalid_argument(fmt::format(
        "--microbatches: --pp {} * --stages-per-rank {} * --microbatches {} = {} stage "
        "microbatches, more than the {} this command simulates",
        request.pp, stages_per_rank, request.microbatches, pairs, kMaxStageMicrobatches));
  }
}

schedule::Schedule from_plugin(const Request& request) {
  const auto plugin = PluginLoader::from_environment().load(PluginKind::schedule, *request.name);
  const int64_t stages_per_rank =
      request.stages_per_rank.value_or(plugin->api().schedule->stages_per_rank);
  check_size(request, stages_per_rank);
  schedule::Schedule compute;
  try {
    compute = schedule::generate(*plugin, request.pp, stages_per_rank, request.microbatches);
  } catch (const Error& error) {
    if (!error.is_input_error()) throw;
    throw Error(error.code(),
                fmt::format("--pp {} --stages-per-rank {} --microbatches {} do not fit schedule "
                            "'{}': {}",
                            request.pp, stages_per_rank, request.microbatches, *request.name,
                            error.what()));
  }
  schedule::Schedule lowered = schedule::lower(compute);
  schedule::validate(lowered);
  return lowered;
}

schedule::Schedule from_csv(const Request& request) {
  const int64_t stages_per_rank = request.stages_per_rank.value_or(1);
  check_size(request, stages_per_rank);
  try {
    return schedule::read_csv(*request.csv, request.pp, stages_per_rank, request.microbatches);
  } catch (const Error& error) {
    throw Error(error.code(), std::string("--csv: ") + error.what());
  }
}

// The distinct start times of all compute actions, ascending: one column of
// the grid each, so actions that start together share a column (with equal
// costs, PyTorch's time steps).
std::vector<double> time_steps(const schedule::Simulation& simulation) {
  std::vector<double> starts;
  for (const auto& timeline : simulation.timelines) {
    for (const auto& timed : timeline) starts.push_back(timed.start);
  }
  std::sort(starts.begin(), starts.end());
  const double tolerance = 1e-9 * std::max(1.0, simulation.makespan);
  starts.erase(std::unique(starts.begin(), starts.end(),
                           [&](double a, double b) { return b - a <= tolerance; }),
               starts.end());
  return starts;
}

// One row per rank, one column per time step, empty where the rank starts
// nothing (idle, or still busy with a longer action).
std::string action_grid(const schedule::Simulation& simulation) {
  const std::vector<double> steps = time_steps(simulation);
  const size_t ranks = simulation.timelines.size();
  std::vector<std::vector<std::string>> cells(ranks + 1, std::vector<std::string>(steps.size()));
  for (size_t column = 0; column < steps.size(); ++column) {
    cells[0][column] = fmt::format("{:g}", steps[column]);
  }
  const double tolerance = 1e-9 * std::max(1.0, simulation.makespan);
  for (size_t rank = 0; rank < ranks; ++rank) {
    for (const auto& timed : simulation.timelines[rank]) {
      const auto column =
          std::lower_bound(steps.begin(), steps.end(), timed.start - tolerance) - steps.begin();
      cells[rank + 1][column] = schedule::format_action(timed.action);
    }
  }
  std::vector<std::string> labels = {"time"};
  for (size_t rank = 0; rank < ranks; ++rank) labels.push_back(fmt::format("rank {}", rank));
  std::vector<size_t> widths(steps.size(), 0);
  for (const auto& line : cells) {
    for (size_t column = 0; column < steps.size(); ++column) {
      widths[column] = std::max(widths[column], line[column].size());
    }
  }
  std::string text;
  for (size_t row = 0; row < cells.size(); ++row) {
    text += fmt::format("{:<{}}", labels[row], labels.back().size());
    for (size_t column = 0; column < steps.size(); ++column) {
      text += fmt::format(" {:<{}}", cells[row][column], widths[column]);
    }
    text += "\n";
  }
  return text;
}

nlohmann::ordered_json costs_json(const schedule::Costs& costs) {
  return {{"F", costs.F}, {"B", costs.B},       {"I", costs.I},
          {"W", costs.W}, {"send", costs.send}, {"recv", costs.recv}};
}

nlohmann::ordered_json to_json(const schedule::Schedule& schedule,
                               const schedule::Simulation& simulation,
                               const schedule::Costs& costs) {
  nlohmann::ordered_json actions = nlohmann::ordered_json::array();
  for (const auto& rank : schedule.ranks) {
    nlohmann::ordered_json strings = nlohmann::ordered_json::array();
    for (const auto& action : rank) {
      if (action) strings.push_back(schedule::format_action(*action));
    }
    actions.push_back(std::move(strings));
  }
  return {{"name", schedule.name},
          {"pp", schedule.pp},
          {"microbatches", schedule.microbatches},
          {"stages_per_rank", schedule.stages_per_rank},
          {"actions", std::move(actions)},
          {"makespan", simulation.makespan},
          {"bubble_fraction", simulation.bubble_fraction},
          {"peak_activations", simulation.peak_activations},
          {"idle", simulation.idle},
          {"costs", costs_json(costs)}};
}

std::string figures(const schedule::Schedule& schedule, const schedule::Simulation& simulation,
                    const schedule::Costs& costs) {
  return fmt::format(
      "{}: pp {}, stages per rank {}, microbatches {}\n"
      "costs: F={:g} B={:g} I={:g} W={:g} send={:g} recv={:g}\n"
      "makespan: {:g}\n"
      "bubble fraction: {:.4f} ({:.2f}% of rank time idle)\n"
      "peak activations per rank: {}\n",
      schedule.name, schedule.pp, schedule.stages_per_rank, schedule.microbatches, costs.F, costs.B,
      costs.I, costs.W, costs.send, costs.recv, simulation.makespan, simulation.bubble_fraction,
      100 * simulation.bubble_fraction, fmt::join(simulation.peak_activations, " "));
}

void write_svg(const std::string& path, const std::string& svg) {
  std::ofstream file(path, std::ios::binary);
  file << svg;
  file.close();
  if (!file) {
    throw invalid_argument(fmt::format("--svg: cannot write '{}': {}", path, std::strerror(errno)));
  }
}

}  // namespace

int run_schedule(const Args& args) {
  try {
    const ParsedArgs parsed = parse_args(args,
                                         {{"pp", true},
                                          {"microbatches", true},
                                          {"stages-per-rank", true},
                                          {"csv", true},
                                          {"costs", true},
                                          {"svg", true},
                                          {"json", false},
                                          {"help", false}},
                                         "schedule");
    if (parsed.has_flag("help")) {
      std::puts(kScheduleUsage);
      return 0;
    }
    const Request request = request_of(parsed);
    const schedule::Schedule schedule = request.csv ? from_csv(request) : from_plugin(request);
    const schedule::Simulation simulation = schedule::simulate(schedule, request.costs);
    if (const auto svg = parsed.value("svg"))
      write_svg(*svg, schedule::to_svg(schedule, simulation));
    if (parsed.has_flag("json")) {
      std::puts(to_json(schedule, simulation, request.costs).dump().c_str());
    } else {
      std::fputs(action_grid(simulation).c_str(), stdout);
      std::fputs(figures(schedule, simulation, request.costs).c_str(), stdout);
    }
    return 0;
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
