#include "simulate/svg.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <vector>

namespace meshrun::schedule {
namespace {

// Layout in pixels.
constexpr double kLeft = 64;  // rank labels
constexpr double kRight = 16;
constexpr double kTop = 56;  // title and legend
constexpr double kRowHeight = 20;
constexpr double kRowGap = 4;
constexpr double kAxisHeight = 28;
constexpr double kUnitWidth = 28;  // one time unit (an F at default cost) when it fits
constexpr double kMaxPlotWidth = 4000;
constexpr double kMinPlotWidth = 720;     // room for the title and legend
constexpr double kDigitWidth = 6.5;       // of the 10px block labels
constexpr double kLegendCharWidth = 7.5;  // of the 12px legend, at most
constexpr double kTickSpacing = 80;       // the least room between time labels
constexpr double kOutlinedScale = 8;      // pixels per time unit from which blocks get outlines

struct Kind {
  ActionType type;
  std::string_view name;
  std::string_view legend;
  std::array<int, 3> rgb;
};

constexpr std::array<Kind, 4> kKinds = {{
    {ActionType::F, "F", "forward", {91, 155, 213}},
    {ActionType::B, "B", "backward", {112, 173, 71}},
    {ActionType::I, "I", "backward input", {237, 125, 49}},
    {ActionType::W, "W", "backward weight", {255, 192, 0}},
}};

struct Layout {
  double scale = kUnitWidth;  // pixels per time unit
  double plot_width = 0;
  double width = 0;
  double height = 0;
  double row_y(int64_t rank) const {
    return kTop + static_cast<double>(rank) * (kRowHeight + kRowGap);
  }
};

Layout layout_for(int64_t ranks, double makespan) {
  Layout layout;
  if (makespan > 0) layout.scale = std::min(kUnitWidth, kMaxPlotWidth / makespan);
  layout.plot_width = makespan * layout.scale;
  layout.width = kLeft + std::max(layout.plot_width, kMinPlotWidth) + kRight;
  layout.height = layout.row_y(ranks) + kAxisHeight;
  return layout;
}

std::string xml_escape(std::string_view text) {
  std::string escaped;
  for (const char c : text) {
    switch (c) {
      case '&':
        escaped += "&amp;";
        break;
      case '<':
        escaped += "&lt;";
        break;
      case '>':
        escaped += "&gt;";
        break;
      case '"':
        escaped += "&quot;";
        break;
      default:
        // XML 1.0 allows no control characters, not even escaped.
        escaped += static_cast<unsigned char>(c) < 0x20 ? '?' : c;
    }
  }
  return escaped;
}

// Per stage: its position among the stages of its rank (0 for the first),
// which picks the shade of its blocks.
std::vector<int64_t> local_stage_indices(const Schedule& schedule) {
  std::vector<int64_t> held(schedule.ranks.size(), 0);
  std::vector<int64_t> local;
  for (const int64_t rank : schedule.stage_rank) {
    const bool known = rank >= 0 && rank < static_cast<int64_t>(held.size());
    local.push_back(known ? held[rank]++ : 0);
  }
  return local;
}

// Base colour mixed towards white: shade 0 is the base, the last of
// `shades` is a little over half white, so black labels stay readable.
std::string shade_of(const Kind& kind, int64_t shade, int64_t shades) {
  const double white =
      shades > 1 ? 0.55 * static_cast<double>(shade) / static_cast<double>(shades - 1) : 0;
  std::array<int, 3> rgb{};
  for (size_t i = 0; i < 3; ++i) {
    rgb[i] = static_cast<int>(std::lround(kind.rgb[i] + (255 - kind.rgb[i]) * white));
  }
  return fmt::format("#{:02x}{:02x}{:02x}", rgb[0], rgb[1], rgb[2]);
}

std::string style(int64_t shades, double scale) {
  // Outlines part neighbouring blocks of one colour, where blocks are wide
  // enough to keep their fill visible.
  const std::string outline = scale >= kOutlinedScale ? ";stroke:#fff;stroke-width:0.75" : "";
  std::string css =
      "text{font-family:sans-serif;font-size:12px}"
      ".mb{font-size:10px;text-anchor:middle;dominant-baseline:central}"
      ".tick{font-size:10px;text-anchor:middle;fill:#555}"
      ".grid{stroke:#eee}.track{fill:none;stroke:#ccc}";
  for (const Kind& kind : kKinds) {
    for (int64_t shade = 0; shade < shades; ++shade) {
      css += fmt::format(".{}{}{{fill:{}{}}}", kind.name, shade, shade_of(kind, shade, shades),
                         outline);
    }
  }
  return "<style>" + css + "</style>\n";
}

std::string header(const Schedule& schedule, const Simulation& simulation, int64_t shades) {
  std::string svg = fmt::format(
      "<text x=\"{}\" y=\"18\">{}: pp {}, stages per rank {}, microbatches {}, makespan {:g}, "
      "bubble {:.2f}%</text>\n",
      kLeft, xml_escape(schedule.name), schedule.pp, schedule.stages_per_rank,
      schedule.microbatches, simulation.makespan, 100 * simulation.bubble_fraction);
  double x = kLeft;
  for (const Kind& kind : kKinds) {
    svg += fmt::format(
        "<rect x=\"{}\" y=\"30\" width=\"14\" height=\"14\" class=\"{}0\"/>"
        "<text x=\"{}\" y=\"41\">{} {}</text>\n",
        x, kind.name, x + 18, kind.name, kind.legend);
    x += 40 + kLegendCharWidth * static_cast<double>(kind.legend.size());
  }
  if (shades == 1) return svg;
  for (int64_t shade = 0; shade < shades; ++shade, x += 10) {
    svg +=
        fmt::format("<rect x=\"{}\" y=\"30\" width=\"10\" height=\"14\" class=\"F{}\"/>", x, shade);
  }
  return svg +
         fmt::format("<text x=\"{}\" y=\"41\">a rank's stages, first to last</text>\n", x + 4);
}

// The step between time labels: 1, 2 or 5 times a power of ten.
double tick_step(double makespan, double plot_width) {
  const double wanted = makespan / std::max(1.0, plot_width / kTickSpacing);
  const double power = std::pow(10.0, std::floor(std::log10(wanted)));
  for (const double factor : {1.0, 2.0, 5.0}) {
    if (factor * power >= wanted) return factor * power;
  }
  return 10 * power;
}

std::string time_axis(const Layout& layout, double makespan, int64_t ranks) {
  if (makespan <= 0) return "";
  std::string svg;
  const double step = tick_step(makespan, layout.plot_width);
  const double bottom = layout.row_y(ranks);
  for (int64_t i = 0; static_cast<double>(i) * step <= makespan * (1 + 1e-12); ++i) {
    const double time = static_cast<double>(i) * step;
    const double x = kLeft + time * layout.scale;
    svg += fmt::format(
        "<line x1=\"{:.2f}\" y1=\"{}\" x2=\"{:.2f}\" y2=\"{}\" class=\"grid\"/>"
        "<text x=\"{:.2f}\" y=\"{}\" class=\"tick\">{:g}</text>\n",
        x, kTop - 4, x, bottom, x, bottom + 14, time);
  }
  return svg;
}

const Kind* kind_of(ActionType type) {
  const auto found = std::find_if(kKinds.begin(), kKinds.end(),
                                  [&](const Kind& kind) { return kind.type == type; });
  return found == kKinds.end() ? nullptr : &*found;
}

void append_block(std::string& svg, const TimedAction& timed, const Layout& layout, double y,
                  int64_t shade) {
  const Kind* kind = kind_of(timed.action.type);
  if (kind == nullptr) return;
  const double x = kLeft + timed.start * layout.scale;
  const double width = (timed.end - timed.start) * layout.scale;
  const auto out = std::back_inserter(svg);
  fmt::format_to(out, "<rect x=\"{:.2f}\" y=\"{}\" width=\"{:.2f}\" height=\"{}\" class=\"{}{}\"",
                 x, y, width, kRowHeight, kind->name, shade);
  const std::string label = std::to_string(timed.action.microbatch);
  // Unlabelled blocks stay one element each: large pictures are mostly these.
  if (width < kDigitWidth * static_cast<double>(label.size()) + 4) {
    svg += "/>\n";
    return;
  }
  fmt::format_to(out,
                 "><title>{} [{:g}, {:g}]</title></rect>"
                 "<text x=\"{:.2f}\" y=\"{}\" class=\"mb\">{}</text>\n",
                 format_action(timed.action), timed.start, timed.end, x + width / 2,
                 y + kRowHeight / 2, label);
}

void append_rank_row(std::string& svg, const Simulation& simulation, const Layout& layout,
                     int64_t rank, const std::vector<int64_t>& local_stage) {
  const double y = layout.row_y(rank);
  fmt::format_to(std::back_inserter(svg),
                 "<text x=\"8\" y=\"{}\">rank {}</text>"
                 "<rect x=\"{}\" y=\"{}\" width=\"{:.2f}\" height=\"{}\" class=\"track\"/>\n",
                 y + kRowHeight / 2 + 4, rank, kLeft, y, layout.plot_width, kRowHeight);
  for (const TimedAction& timed : simulation.timelines[rank]) {
    const auto stage = static_cast<size_t>(timed.action.stage);
    append_block(svg, timed, layout, y, stage < local_stage.size() ? local_stage[stage] : 0);
  }
}

}  // namespace

std::string to_svg(const Schedule& schedule, const Simulation& simulation) {
  const auto ranks = static_cast<int64_t>(simulation.timelines.size());
  const Layout layout = layout_for(ranks, simulation.makespan);
  const std::vector<int64_t> local_stage = local_stage_indices(schedule);
  const int64_t shades =
      local_stage.empty() ? 1 : *std::max_element(local_stage.begin(), local_stage.end()) + 1;
  std::string svg = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" "
      "viewBox=\"0 0 {0:.0f} {1:.0f}\">\n",
      std::ceil(layout.width), std::ceil(layout.height));
  svg += style(shades, layout.scale);
  svg += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg += header(schedule, simulation, shades);
  svg += time_axis(layout, simulation.makespan, ranks);
  for (int64_t rank = 0; rank < ranks; ++rank) {
    append_rank_row(svg, simulation, layout, rank, local_stage);
  }
  return svg + "</svg>\n";
}

}  // namespace meshrun::schedule
