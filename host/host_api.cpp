// The C host API (abi/include/meshrun/host.h) over the C++ core. Every entry
// point catches everything and returns an error object: nothing throws
// across the boundary.
#include "meshrun/host.h"

#include <fmt/format.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "host_api.hpp"

namespace {

using meshrun::Axis;
using meshrun::Error;
using meshrun::host_api::adopt;
using meshrun::host_api::guarded;
using meshrun::host_api::live;
using meshrun::host_api::require;

Axis axis_named(const char* name) {
  require(name, "axis");
  return meshrun::require_axis(name);
}

// The mesh of a built runtime, checking that MoE axes exist when asked for.
const meshrun::MeshContext& mesh_for(const meshrun_runtime* runtime, Axis axis) {
  const auto& mesh = live(runtime, "runtime").runtime.mesh();
  if ((axis == Axis::ep || axis == Axis::ep_shard) && !mesh.has_moe()) {
    throw Error(MESHRUN_NOT_FOUND,
                fmt::format("axis '{}' needs an MoE mesh, but distributed.ep_size is 1",
                            meshrun::axis_name(axis)));
  }
  return mesh;
}

void require_rank(const meshrun::MeshContext& mesh, int64_t rank) {
  if (rank < 0 || rank >= mesh.world_size()) {
    throw Error(MESHRUN_OUT_OF_RANGE,
                fmt::format("rank {} is outside [0, {})", rank, mesh.world_size()));
  }
}

void copy_ranks(const std::vector<int64_t>& ranks, int64_t* out_ranks, int64_t capacity,
                int64_t* out_count) {
  require(out_count, "out_count");
  *out_count = static_cast<int64_t>(ranks.size());
  if (capacity < *out_count) {
    throw Error(MESHRUN_OUT_OF_RANGE,
                fmt::format("capacity {} is smaller than the group size {}", capacity, *out_count));
  }
  require(out_ranks, "out_ranks");
  std::copy(ranks.begin(), ranks.end(), out_ranks);
}

std::string read_file(const char* path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    throw Error(MESHRUN_NOT_FOUND,
                fmt::format("cannot read config file '{}': {}", path, std::strerror(errno)));
  }
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

}  // namespace

extern "C" {

int32_t meshrun_abi_version_major(void) { return MESHRUN_ABI_VERSION_MAJOR; }
int32_t meshrun_abi_version_minor(void) { return MESHRUN_ABI_VERSION_MINOR; }
const char* meshrun_library_version(void) { return MESHRUN_LIBRARY_VERSION; }

meshrun_error* meshrun_runtime_create_from_text(const char* toml_text, const char* source_name,
                                                meshrun_runtime** out) {
  return guarded(__func__, [&] {
    require(toml_text, "toml_text");
    require(out, "out");
    *out = adopt(std::make_unique<meshrun_runtime>(
        meshrun_runtime{meshrun::Runtime(toml_text, source_name ? source_name : "<string>"), {}}));
  });
}

meshrun_error* meshrun_runtime_create_from_file(const char* path, meshrun_runtime** out) {
  return guarded(__func__, [&] {
    require(path, "path");
    require(out, "out");
    *out = adopt(std::make_unique<meshrun_runtime>(
        meshrun_runtime{meshrun::Runtime(read_file(path), path), {}}));
  });
}

void meshrun_runtime_destroy(meshrun_runtime* runtime) {
  if (!meshrun::host_api::forget_handle(runtime)) return;
  for (const auto& [axis, comm] : runtime->comms) meshrun::host_api::forget_handle(comm.get());
  delete runtime;
}

meshrun_error* meshrun_runtime_override(meshrun_runtime* runtime, const char* assignment) {
  return guarded(__func__, [&] {
    live(runtime, "runtime");
    require(assignment, "assignment");
    runtime->runtime.apply_override(assignment);
  });
}

meshrun_error* meshrun_runtime_build_mesh(meshrun_runtime* runtime, int64_t world_size,
                                          int64_t rank) {
  return guarded(__func__, [&] {
    live(runtime, "runtime");
    runtime->runtime.build_mesh(world_size, rank);
  });
}

meshrun_error* meshrun_mesh_axis_size(const meshrun_runtime* runtime, const char* axis,
                                      int64_t* out_size) {
  return guarded(__func__, [&] {
    const Axis which = axis_named(axis);
    const auto& mesh = mesh_for(runtime, which);
    require(out_size, "out_size");
    *out_size = mesh.axis_size(which);
  });
}

meshrun_error* meshrun_mesh_coordinate(const meshrun_runtime* runtime, int64_t rank,
                                       const char* axis, int64_t* out_index) {
  return guarded(__func__, [&] {
    const Axis which = axis_named(axis);
    const auto& mesh = mesh_for(runtime, which);
    require_rank(mesh, rank);
    require(out_index, "out_index");
    *out_index = mesh.coordinate(rank, which);
  });
}

meshrun_error* meshrun_mesh_group_count(const meshrun_runtime* runtime, const char* axis,
                                        int64_t* out_count) {
  return guarded(__func__, [&] {
    const Axis which = axis_named(axis);
    const auto& mesh = mesh_for(runtime, which);
    require(out_count, "out_count");
    *out_count = mesh.group_count(which);
  });
}

meshrun_error* meshrun_mesh_group_ranks(const meshrun_runtime* runtime, const char* axis,
                                        int64_t rank, int64_t* out_ranks, int64_t capacity,
                                        int64_t* out_count) {
  return guarded(__func__, [&] {
    const Axis which = axis_named(axis);
    const auto& mesh = mesh_for(runtime, which);
    require_rank(mesh, rank);
    copy_ranks(mesh.group_ranks(which, rank), out_ranks, capacity, out_count);
  });
}

meshrun_error* meshrun_mesh_group_ranks_by_index(const meshrun_runtime* runtime, const char* axis,
                                                 int64_t group, int64_t* out_ranks,
                                                 int64_t capacity, int64_t* out_count) {
  return guarded(__func__, [&] {
    const Axis which = axis_named(axis);
    const auto& mesh = mesh_for(runtime, which);
    if (group < 0 || group >= mesh.group_count(which)) {
      throw Error(MESHRUN_OUT_OF_RANGE, fmt::format("group {} of axis '{}' is outside [0, {})",
                                                    group, axis, mesh.group_count(which)));
    }
    copy_ranks(mesh.group_ranks_by_index(which, group), out_ranks, capacity, out_count);
  });
}

meshrun_error* meshrun_runtime_plan_json(const meshrun_runtime* runtime, char** out_json) {
  return guarded(__func__, [&] {
    live(runtime, "runtime");
    require(out_json, "out_json");
    *out_json = meshrun::host_api::malloc_string(
        meshrun::plan_to_json(runtime->runtime.plan(), false).dump());
  });
}

void meshrun_string_destroy(char* string) { std::free(string); }

meshrun_error* meshrun_runtime_join(meshrun_runtime* runtime) {
  return guarded(__func__, [&] {
    live(runtime, "runtime");
    runtime->runtime.join();
  });
}

meshrun_error* meshrun_runtime_rank(const meshrun_runtime* runtime, int64_t* out_rank,
                                    int64_t* out_world_size, int64_t* out_local_rank) {
  return guarded(__func__, [&] {
    live(runtime, "runtime");
    const auto& job = runtime->runtime.job();
    if (out_rank != nullptr) *out_rank = job->world().rank();
    if (out_world_size != nullptr) *out_world_size = job->world().size();
    if (out_local_rank != nullptr) *out_local_rank = job->local_rank();
  });
}

meshrun_error* meshrun_runtime_comm(meshrun_runtime* runtime, const char* axis,
                                    meshrun_comm** out) {
  return guarded(__func__, [&] {
    live(runtime, "runtime");
    require(axis, "axis");
    require(out, "out");
    auto& comm = runtime->comms[axis];
    if (!comm) {
      const auto& job = runtime->runtime.job();
      comm = std::make_unique<meshrun_comm>(meshrun_comm{job, &job->communicator(axis)});
      meshrun::host_api::register_handle(comm.get(), "meshrun_comm");
    }
    *out = comm.get();
  });
}

}  // extern "C"
