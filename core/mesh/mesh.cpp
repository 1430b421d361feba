#include "mesh/mesh.hpp"

#include <fmt/format.h>

#include <initializer_list>
#include <limits>

#include "errors.hpp"
#include "support/suggest.hpp"

namespace meshrun {
namespace {

constexpr std::array<std::string_view, 10> kAxisNames = {
    "pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "ep_shard", "ep"};

// Index of each mesh axis in MeshContext::shape_.
constexpr size_t kPp = 0;
constexpr size_t kDpReplicate = 1;
constexpr size_t kDpShard = 2;
constexpr size_t kCp = 3;
constexpr size_t kTp = 4;

// A size from the config together with its key, so messages can name both.
struct NamedSize {
  std::string_view key;  // without the "distributed." prefix
  int64_t value;
};

// The validated result, before it is stored in a MeshContext.
struct Shape {
  std::array<int64_t, 5> dims{1, 1, 1, 1, 1};
  int64_t ep_shard = 1;
  int64_t ep = 1;
};

[[noreturn]] void fail(std::string_view key, const std::string& message) {
  throw Error(MESHRUN_INVALID_ARGUMENT, message, "distributed." + std::string(key));
}

// Sizes come straight from a config, so a product may not fit in int64.
std::optional<int64_t> checked_product(std::initializer_list<NamedSize> factors) {
  int64_t product = 1;
  for (const auto& factor : factors) {
    if (__builtin_mul_overflow(product, factor.value, &product)) return std::nullopt;
  }
  return product;
}

std::string product_text(const std::optional<int64_t>& product) {
  return product ? std::to_string(*product)
                 : fmt::format("more than {}", std::numeric_limits<int64_t>::max());
}

std::string names_text(std::initializer_list<NamedSize> factors) {
  std::string text;
  for (const auto& factor : factors) {
    if (!text.empty()) text += " * ";
    text += factor.key;
  }
  return text;
}

std::string values_text(std::initializer_list<NamedSize> factors) {
  std::string text;
  for (const auto& factor : factors) {
    if (!text.empty()) text += ", ";
    text += fmt::format("distributed.{} = {}", factor.key, factor.value);
  }
  return text;
}

// The factor after which the running product stops dividing the world: the
// one the user most likely has to change.
std::string_view misfit_factor(int64_t world_size, std::initializer_list<NamedSize> factors) {
  int64_t running = 1;
  for (const auto& factor : factors) {
    if (__builtin_mul_overflow(running, factor.value, &running) || world_size % running != 0) {
      return factor.key;
    }
  }
  return "tp_size";  // not reached: called only when the product does not divide the world
}

void require_positive(const ParallelismSizes& sizes) {
  for (const NamedSize size :
       {NamedSize{"dp_replicate_size", sizes.dp_replicate_size},
        NamedSize{"tp_size", sizes.tp_size}, NamedSize{"pp_size", sizes.pp_size},
        NamedSize{"cp_size", sizes.cp_size}, NamedSize{"ep_size", sizes.ep_size}}) {
    if (size.value < 1) {
      fail(size.key, fmt::format("distributed.{} ({}) must be >= 1", size.key, size.value));
    }
  }
}

void reject_above_one(NamedSize size, MeshFamily family, std::string_view why) {
  if (size.value > 1) {
    fail(size.key, fmt::format("distributed.{} ({}) must be 1 with strategy {}: {}", size.key,
                               size.value, mesh_family_name(family), why));
  }
}

[[noreturn]] void fail_dp_size(const ParallelismSizes& sizes, int64_t world_size, int64_t dp,
                               std::initializer_list<NamedSize> factors, int64_t model_parallel) {
  std::string product = fmt::format("dp_size = {}", sizes.dp_size);
  if (factors.size() > 0) {
    int64_t total = 0;
    const bool overflow = __builtin_mul_overflow(sizes.dp_size, model_parallel, &total);
    product =
        fmt::format("dp_size * ({}) = {} * {} = {}", names_text(factors), sizes.dp_size,
                    model_parallel, product_text(overflow ? std::nullopt : std::optional(total)));
  }
  fail("dp_size",
       fmt::format("distributed.dp_size ({}) does not fit world_size ({}): {}, not {}; leave "
                   "distributed.dp_size unset to derive dp = {}",
                   sizes.dp_size, world_size, product, world_size, dp));
}

// dp = world / product(factors); an explicit dp_size must agree with it.
int64_t derive_dp(const ParallelismSizes& sizes, int64_t world_size,
                  std::initializer_list<NamedSize> factors) {
  const std::optional<int64_t> model_parallel = checked_product(factors);
  if (!model_parallel || world_size % *model_parallel != 0) {
    fail(misfit_factor(world_size, factors),
         fmt::format("world_size ({}) must be divisible by ({}) ({}): {}", world_size,
                     names_text(factors), product_text(model_parallel), values_text(factors)));
  }
  const int64_t dp = world_size / *model_parallel;
  // AutoModel only fails on a disagreeing dp_size once the device mesh is
  // built; a plan can say so now.
  if (sizes.dp_size > 0 && sizes.dp_size != dp) {
    fail_dp_size(sizes, world_size, dp, factors, *model_parallel);
  }
  return dp;
}

Shape resolve_fsdp2_moe(Shape shape, int64_t ep_size) {
  if (ep_size == 1) return shape;
  const int64_t non_pp =
      shape.dims[kDpReplicate] * shape.dims[kDpShard] * shape.dims[kCp] * shape.dims[kTp];
  if (non_pp % ep_size != 0) {
    fail("ep_size", fmt::format("dp * cp * tp ({} ranks per pipeline stage) must be a multiple of "
                                "distributed.ep_size ({})",
                                non_pp, ep_size));
  }
  shape.ep_shard = non_pp / ep_size;
  shape.ep = ep_size;
  return shape;
}

Shape resolve_fsdp2(const ParallelismSizes& sizes, int64_t world_size) {
  const int64_t dp = derive_dp(
      sizes, world_size,
      {{"tp_size", sizes.tp_size}, {"cp_size", sizes.cp_size}, {"pp_size", sizes.pp_size}});
  const int64_t replicate = sizes.dp_replicate_size;
  if (replicate != 1 && replicate >= dp) {
    fail("dp_replicate_size",
         fmt::format("distributed.dp_replicate_size ({}) must be less than dp ({}) with strategy "
                     "fsdp2: pure replication is DDP's job (use strategy ddp)",
                     replicate, dp));
  }
  if (dp % replicate != 0) {
    fail("dp_replicate_size",
         fmt::format("dp ({}) must be divisible by distributed.dp_replicate_size ({})", dp,
                     replicate));
  }
  Shape shape;
  shape.dims = {sizes.pp_size, replicate, dp / replicate, sizes.cp_size, sizes.tp_size};
  return resolve_fsdp2_moe(shape, sizes.ep_size);
}

Shape resolve_megatron_fsdp(const ParallelismSizes& sizes, int64_t world_size) {
  constexpr MeshFamily family = MeshFamily::megatron_fsdp;
  reject_above_one({"pp_size", sizes.pp_size}, family, "its mesh is (dp, cp, tp), no pipeline");
  reject_above_one({"ep_size", sizes.ep_size}, family, "its mesh is (dp, cp, tp), no MoE mesh");
  reject_above_one({"dp_replicate_size", sizes.dp_replicate_size}, family,
                   "no HSDP; dp_replicate_size > 1 only with fsdp2");
  const int64_t dp =
      derive_dp(sizes, world_size, {{"tp_size", sizes.tp_size}, {"cp_size", sizes.cp_size}});
  if (sizes.replicate_data_parallel && sizes.cp_size > 1) {
    fail("cp_size", fmt::format("distributed.cp_size ({}) must be 1 with zero_dp_strategy 0: "
                                "ZeRO-0 replicates the parameters over dp and cp, and meshrun's "
                                "mesh shards them over cp (dp_shard_cp)",
                                sizes.cp_size));
  }
  Shape shape;
  shape.dims = sizes.replicate_data_parallel
                   ? std::array<int64_t, 5>{1, dp, 1, sizes.cp_size, sizes.tp_size}
                   : std::array<int64_t, 5>{1, 1, dp, sizes.cp_size, sizes.tp_size};
  return shape;
}

Shape resolve_ddp(const ParallelismSizes& sizes, int64_t world_size) {
  constexpr MeshFamily family = MeshFamily::ddp;
  constexpr std::string_view why = "it replicates the whole model on every rank";
  reject_above_one({"tp_size", sizes.tp_size}, family, why);
  reject_above_one({"pp_size", sizes.pp_size}, family, why);
  reject_above_one({"cp_size", sizes.cp_size}, family, why);
  reject_above_one({"ep_size", sizes.ep_size}, family, why);
  reject_above_one({"dp_replicate_size", sizes.dp_replicate_size}, family,
                   "dp_replicate_size > 1 only with fsdp2 (ddp already replicates over all ranks)");
  Shape shape;
  shape.dims = {1, derive_dp(sizes, world_size, {}), 1, 1, 1};
  return shape;
}

Shape resolve_shape(const ParallelismSizes& sizes, int64_t world_size, MeshFamily family) {
  switch (family) {
    case MeshFamily::fsdp2:
      return resolve_fsdp2(sizes, world_size);
    case MeshFamily::megatron_fsdp:
      return resolve_megatron_fsdp(sizes, world_size);
    case MeshFamily::ddp:
      return resolve_ddp(sizes, world_size);
  }
  throw Error(MESHRUN_INVALID_ARGUMENT,
              fmt::format("unknown mesh family ({})", static_cast<int32_t>(family)));
}

[[noreturn]] void unknown_axis(Axis axis) {
  throw Error(MESHRUN_INVALID_ARGUMENT,
              fmt::format("unknown mesh axis ({})", static_cast<int32_t>(axis)));
}

size_t axis_index(Axis axis) {
  const auto index = static_cast<size_t>(axis);
  if (index >= kAxisNames.size()) unknown_axis(axis);
  return index;
}

}  // namespace

std::string_view mesh_family_name(MeshFamily family) {
  switch (family) {
    case MeshFamily::fsdp2:
      return "fsdp2";
    case MeshFamily::megatron_fsdp:
      return "megatron_fsdp";
    case MeshFamily::ddp:
      return "ddp";
  }
  return "unknown";
}

std::string_view axis_name(Axis axis) { return kAxisNames[axis_index(axis)]; }

std::optional<Axis> axis_from_name(std::string_view name) {
  for (size_t i = 0; i < kAxisNames.size(); ++i) {
    if (kAxisNames[i] == name) return static_cast<Axis>(i);
  }
  return std::nullopt;
}

std::vector<std::string> all_axis_names() { return {kAxisNames.begin(), kAxisNames.end()}; }

Axis require_axis(std::string_view name) {
  if (const auto axis = axis_from_name(name)) return *axis;
  const auto names = all_axis_names();
  throw Error(MESHRUN_NOT_FOUND, fmt::format("unknown mesh axis '{}'{}; valid: {}", name,
                                             did_you_mean(name, names), join_names(names)));
}

MeshContext::Layout MeshContext::layout(Axis axis) const {
  const auto& s = shape_;
  switch (axis) {
    case Axis::pp:
      return {s[kPp], s[kDpReplicate] * s[kDpShard] * s[kCp] * s[kTp]};
    case Axis::dp_replicate:
      return {s[kDpReplicate], s[kDpShard] * s[kCp] * s[kTp]};
    case Axis::dp_shard:
      return {s[kDpShard], s[kCp] * s[kTp]};
    case Axis::cp:
      return {s[kCp], s[kTp]};
    case Axis::tp:
      return {s[kTp], 1};
    // Flattened axes merge neighbouring dimensions: the innermost part's
    // stride, the parts' product as size.
    case Axis::dp:
      return {s[kDpReplicate] * s[kDpShard], s[kCp] * s[kTp]};
    case Axis::dp_shard_cp:
      return {s[kDpShard] * s[kCp], s[kTp]};
    case Axis::dp_cp:
      return {s[kDpReplicate] * s[kDpShard] * s[kCp], s[kTp]};
    // Each pipeline stage's ranks are contiguous, so the MoE mesh is a
    // row-major (ep_shard, ep) view inside every stage.
    case Axis::ep_shard:
      return {ep_shard_, ep_};
    case Axis::ep:
      return {ep_, 1};
  }
  unknown_axis(axis);
}

void MeshContext::check_rank(int64_t rank) const {
  if (rank < 0 || rank >= world_size_) {
    throw Error(MESHRUN_OUT_OF_RANGE,
                fmt::format("rank {} is out of range: world_size is {}", rank, world_size_));
  }
}

int64_t MeshContext::axis_size(Axis axis) const { return layout(axis).size; }

int64_t MeshContext::coordinate(int64_t rank, Axis axis) const {
  check_rank(rank);
  const Layout l = layout(axis);
  return rank / l.stride % l.size;
}

int64_t MeshContext::group_count(Axis axis) const { return world_size_ / axis_size(axis); }

std::vector<int64_t> MeshContext::group_ranks(Axis axis, int64_t rank) const {
  check_rank(rank);
  const Layout l = layout(axis);
  const int64_t first = rank - rank / l.stride % l.size * l.stride;
  std::vector<int64_t> ranks(static_cast<size_t>(l.size));
  for (int64_t i = 0; i < l.size; ++i) ranks[static_cast<size_t>(i)] = first + i * l.stride;
  return ranks;
}

std::vector<int64_t> MeshContext::group_ranks_by_index(Axis axis, int64_t group) const {
  const int64_t count = group_count(axis);
  if (group < 0 || group >= count) {
    throw Error(MESHRUN_OUT_OF_RANGE,
                fmt::format("group {} of axis {} is out of range: it has {} groups", group,
                            axis_name(axis), count));
  }
  // A group's lowest rank has index 0 on the axis; in increasing order those
  // ranks are (g / stride) * (size * stride) + g % stride.
  const Layout l = layout(axis);
  return group_ranks(axis, group / l.stride * l.size * l.stride + group % l.stride);
}

MeshContext resolve_mesh(const ParallelismSizes& sizes, int64_t world_size, MeshFamily family) {
  if (world_size < 1) {
    throw Error(MESHRUN_INVALID_ARGUMENT, fmt::format("world_size ({}) must be >= 1", world_size),
                "world_size");
  }
  require_positive(sizes);
  const Shape shape = resolve_shape(sizes, world_size, family);
  MeshContext mesh;
  mesh.world_size_ = world_size;
  mesh.family_ = family;
  mesh.shape_ = shape.dims;
  mesh.ep_shard_ = shape.ep_shard;
  mesh.ep_ = shape.ep;
  return mesh;
}

}  // namespace meshrun
