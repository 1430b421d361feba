// The data-parallel trainer over two worlds of the same ranks, on the CPU:
// the trainer's host-side collectives on the launcher's world and the
// strategies' and the model's on another communicator (a split of it), as
// a GPU run puts them on an NCCL world (train::train_in_worlds), with a
// pipeline's transfers over the state's pp and context parallelism's
// all-to-alls and loss sum over the state's cp too. The losses,
// gradient norms, validation losses and exported weights must equal the
// one-world run's bit for bit: the worlds hold the same ranks in the same
// order, so every sum is the same sum. Run under mpirun with 2 ranks;
// argv[1] is the examples folder, argv[2] a folder for the runs.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "plugin/loader.hpp"
#include "state/state_device.hpp"
#include "train/run.hpp"

namespace {

using meshrun::Communicator;

struct Case {
  std::string name, example;
  std::vector<std::string> overrides;
};

std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// What each step reported that the two runs must share.
std::vector<std::string> step_figures(const std::filesystem::path& output) {
  std::vector<std::string> figures;
  std::ifstream in(output / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto step = nlohmann::json::parse(line);
    std::string figure = fmt::format("step {} loss {} grad_norm {}", step["step"].dump(),
                                     step["loss"].dump(), step["grad_norm"].dump());
    if (step.contains("val_loss")) figure += " val_loss " + step["val_loss"].dump();
    figures.push_back(figure);
  }
  return figures;
}

// Rank 0's verdict: the failures' count.
int compare(const Case& c, const std::filesystem::path& one, const std::filesystem::path& two) {
  int failures = 0;
  const auto a = step_figures(one), b = step_figures(two);
  if (a.empty() || a != b) {
    std::printf("FAIL %s: the steps differ\n", c.name.c_str());
    for (size_t k = 0; k < std::max(a.size(), b.size()); ++k) {
      std::printf("  one world: %s\n  two worlds: %s\n", k < a.size() ? a[k].c_str() : "-",
                  k < b.size() ? b[k].c_str() : "-");
    }
    ++failures;
  }
  const std::string weights = file_bytes(one / "model.safetensors");
  if (weights.empty() || weights != file_bytes(two / "model.safetensors")) {
    std::printf("FAIL %s: the exported weights differ\n", c.name.c_str());
    ++failures;
  }
  if (failures == 0) std::printf("PASS %s: %s\n", c.name.c_str(), a.back().c_str());
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s EXAMPLES_DIR RUNS_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path examples = argv[1], runs = argv[2];
  // Small and short: the same code paths as the examples, in seconds.
  const std::vector<std::string> shared = {"train.steps=2", "train.val_every=2", "data.seq_len=64",
                                           "checkpoint.export=true"};
  const std::vector<Case> cases = {
      {"llama, fsdp2 (bfloat16 gathers)", "llama-tiny.toml", {}},
      {"llama, ddp", "llama-tiny.toml", {"distributed.strategy=ddp"}},
      {"llama, tp 2", "tensor-parallel.toml", {}},
      {"llama, cp 2 (ring)", "llama-tiny.toml", {"distributed.cp_size=2"}},
      {"llama, cp 2 (Ulysses)",
       "llama-tiny.toml",
       {"distributed.cp_size=2", "distributed.cp_ulysses_degree=2"}},
      {"mixtral, ep 2 (the experts' own strategy)", "moe-ep.toml", {}},
      {"llama, pp 2 (1f1b)", "pipeline-1f1b.toml", {}},
      {"llama, pp 2 (zero-bubble V: two stages a rank, I and W)",
       "pipeline-1f1b.toml",
       {"distributed.pipeline.pp_schedule=zbv_zero_bubble",
        "distributed.pipeline.pp_recv_buffer_pool=true"}},
  };
  meshrun::CommBackend backend(meshrun::PluginLoader::from_environment(), "mpi");
  Communicator world = backend.world(120.0);
  Communicator state_world = world.split(0, world.rank(), "state world");
  const meshrun::train::GemmPeakMeter stated = [](const std::string&, double) {
    return meshrun::train::GemmPeak{1e11, "stated by the test"};
  };
  int failures = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    std::vector<std::string> overrides = shared;
    overrides.insert(overrides.end(), c.overrides.begin(), c.overrides.end());
    const meshrun::Config config = meshrun::load_config((examples / c.example).string(), overrides);
    const auto one = runs / fmt::format("case{}-one-world", k);
    const auto two = runs / fmt::format("case{}-two-worlds", k);
    meshrun::train::train_in_process(config, one.string(), stated, world, {});
    meshrun::train::train_in_worlds(config, two.string(), stated, world, state_world,
                                    {meshrun::host_state_device()}, {});
    if (world.rank() == 0) failures += compare(c, one, two);
  }
  return world.rank() == 0 && failures > 0 ? 1 : 0;
}
