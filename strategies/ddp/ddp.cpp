// The ddp strategy: PyTorch DistributedDataParallel semantics over the host's
// flat float32 parameter and gradient buffers.
//
// Every data-parallel rank holds all parameters. At the start rank 0's
// parameters are broadcast. The gradient buffer is cut into buckets in
// reverse parameter order (buckets.hpp); during the backward of the
// micro-batch that ends a step, a bucket's all-reduce (average, in place)
// starts as soon as its last parameter is reported ready, so communication
// overlaps the rest of backward, and finish_gradients waits only for what is
// still in flight. Earlier micro-batches reduce nothing: gradients accumulate
// in the host's buffer (deferred sync, DDP's no_sync).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "buckets.hpp"
#include "meshrun/plugin.hpp"

namespace {

using meshrun::plugin::Error;
using Json = nlohmann::json;

constexpr int64_t kElementBytes = sizeof(float);
constexpr double kBytesPerMb = 1024.0 * 1024.0;

[[noreturn]] void invalid(const std::string& message) {
  throw Error(MESHRUN_INVALID_ARGUMENT, "ddp: " + message);
}

[[noreturn]] void out_of_order(const std::string& message) {
  throw Error(MESHRUN_FAILED_PRECONDITION, "ddp: " + message);
}

// Throws the comm backend's error with `context`, releasing it through its
// own destroy (the backend made it).
void throw_if_error(meshrun_error* error, const std::string& context) {
  if (error == nullptr) return;
  const int32_t code = error->code;
  const std::string message = error->message != nullptr ? error->message : "(no message)";
  meshrun_error_release(error);
  throw Error(code, "ddp: " + context + ": " + message);
}

// The DDPConfig keys of the [distributed] object this strategy reads.
struct Options {
  double bucket_cap_mb = meshrun::ddp::kDefaultBucketCapMb;
  bool find_unused_parameters = false;
};

bool boolean_option(const Json& options, const char* key) {
  const auto found = options.find(key);
  if (found == options.end()) return false;
  if (!found->is_boolean()) {
    invalid(std::string("option '") + key + "' must be true or false, not " + found->dump());
  }
  return found->get<bool>();
}

Options parse_options(const char* options_json) {
  if (options_json == nullptr) invalid("setup: options_json is NULL");
  Json options;
  try {
    options = Json::parse(options_json);
  } catch (const Json::parse_error& e) {
    invalid(std::string("setup: options_json is not JSON: ") + e.what());
  }
  if (!options.is_object()) invalid("setup: options_json must be a JSON object");
  Options parsed;
  const auto cap = options.find("bucket_cap_mb");
  // AutoModel's bucket_cap_mb = None means PyTorch's default.
  if (cap != options.end() && !cap->is_null()) {
    if (!cap->is_number() || !std::isfinite(cap->get<double>()) || cap->get<double>() <= 0) {
      invalid("option 'bucket_cap_mb' must be a positive number of MiB, not " + cap->dump());
    }
    parsed.bucket_cap_mb = cap->get<double>();
  }
  parsed.find_unused_parameters = boolean_option(options, "find_unused_parameters");
  // Read only to check their type: the host's gradients are already one flat
  // buffer whose ranges are the buckets, so gradient_as_bucket_view = true
  // holds as it is and false would only add a copy nobody can observe; the
  // bucket order is fixed, which is what static_graph promises; the host's
  // models have no buffers to broadcast.
  for (const char* key : {"gradient_as_bucket_view", "static_graph", "broadcast_buffers"}) {
    boolean_option(options, key);
  }
  return parsed;
}

// Checks a setup tensor is a compact one-dimensional float32 view of
// `numel` elements on the backend's device.
void check_buffer(const DLTensor& tensor, const char* name, int64_t numel, int32_t device_type) {
  const std::string what = std::string("setup: ") + name;
  if (tensor.dtype.code != kDLFloat || tensor.dtype.bits != 32 || tensor.dtype.lanes != 1) {
    invalid(what + " must be float32");
  }
  if (tensor.ndim != 1 || tensor.shape == nullptr) invalid(what + " must be one-dimensional");
  if (tensor.shape[0] != numel) {
    invalid(what + " has " + std::to_string(tensor.shape[0]) +
            " elements but the parameter offsets end at " + std::to_string(numel));
  }
  if (tensor.strides != nullptr && tensor.strides[0] != 1) invalid(what + " must be contiguous");
  if (tensor.data == nullptr && numel > 0) invalid(what + " data is NULL");
  if (tensor.device.device_type != device_type) {
    invalid(what + " is on device type " + std::to_string(tensor.device.device_type) +
            " but the comm backend moves device type " + std::to_string(device_type));
  }
}

class Ddp {
 public:
  explicit Ddp(const meshrun_host_services& host) : host_(&host) {}
  Ddp(const Ddp&) = delete;
  Ddp& operator=(const Ddp&) = delete;
  // Requests still in flight (a step abandoned after an error) are released;
  // request_destroy waits for them, as the buffer they write stays the host's.
  ~Ddp() {
    for (Bucket& bucket : buckets_) {
      if (bucket.request != nullptr) comm_->request_destroy(bucket.request);
    }
  }

  void setup(const meshrun_strategy_setup* setup) {
    if (comm_ != nullptr) out_of_order("setup was already called on this instance");
    if (setup == nullptr) invalid("setup: setup is NULL");
    if (setup->struct_size < MESHRUN_STRUCT_SIZE(meshrun_strategy_setup, options_json)) {
      invalid("setup: struct_size " + std::to_string(setup->struct_size) + " is too small");
    }
    if (setup->comm == nullptr || setup->comm->struct_size < MESHRUN_COMM_API_SIZE_1_1) {
      invalid("setup: comm is NULL or lacks the ABI 1.1 communication functions");
    }
    if (setup->data_parallel == nullptr) invalid("setup: data_parallel is NULL");
    const Options options = parse_options(setup->options_json);
    check_layout(*setup);
    const int64_t numel = setup->parameter_offsets[setup->num_parameters];
    check_buffer(setup->parameters, "parameters", numel, setup->comm->device_type);
    check_buffer(setup->gradients, "gradients", numel, setup->comm->device_type);

    find_unused_parameters_ = options.find_unused_parameters;
    offsets_.assign(setup->parameter_offsets, setup->parameter_offsets + setup->num_parameters + 1);
    names_.assign(setup->parameter_names, setup->parameter_names + setup->num_parameters);
    parameters_ = setup->parameters;
    gradients_ = setup->gradients;
    const auto cap_bytes = static_cast<int64_t>(options.bucket_cap_mb * kBytesPerMb);
    for (const auto& planned :
         meshrun::ddp::plan_buckets(offsets_, kElementBytes, std::max<int64_t>(cap_bytes, 1))) {
      buckets_.push_back(Bucket{planned, planned.end - planned.begin, 0, nullptr});
    }
    bucket_of_.resize(names_.size());
    for (size_t b = 0; b < buckets_.size(); ++b) {
      for (int64_t p = buckets_[b].plan.first_parameter; p < buckets_[b].plan.end_parameter; ++p) {
        bucket_of_[static_cast<size_t>(p)] = b;
      }
    }
    ready_.assign(names_.size(), false);
    data_parallel_ = setup->data_parallel;
    comm_ = setup->comm;
    log(MESHRUN_LOG_DEBUG, "ddp: " + std::to_string(buckets_.size()) + " gradient buckets over " +
                               std::to_string(names_.size()) + " parameters, bucket_cap_mb " +
                               std::to_string(options.bucket_cap_mb));
  }

  void broadcast_parameters() {
    require_setup("broadcast_parameters");
    if (in_micro_batch_) out_of_order("broadcast_parameters during a micro-batch");
    throw_if_error(comm_->broadcast(data_parallel_, &parameters_, 0, nullptr),
                   "broadcast of the parameters from data-parallel rank 0");
  }

  void begin_micro_batch(bool sync) {
    require_setup("begin_micro_batch");
    if (in_micro_batch_ && sync_) {
      out_of_order("begin_micro_batch after the step's sync micro-batch without finish_gradients");
    }
    in_micro_batch_ = true;
    sync_ = sync;
    std::fill(ready_.begin(), ready_.end(), false);
    for (Bucket& bucket : buckets_) bucket.unready = parameters_in(bucket);
    next_launch_ = 0;
    if (sync_) launch_ready_buckets();
  }

  void gradients_ready(int64_t begin, int64_t end) {
    require_setup("gradients_ready");
    if (!in_micro_batch_) out_of_order("gradients_ready outside a micro-batch");
    const int64_t numel = offsets_.back();
    if (begin < 0 || end > numel || begin > end) {
      throw Error(MESHRUN_OUT_OF_RANGE, "ddp: gradients_ready range [" + std::to_string(begin) +
                                            ", " + std::to_string(end) + ") is not within [0, " +
                                            std::to_string(numel) + ")");
    }
    // Parameters are found by their first element; the range must start and
    // end on parameter boundaries.
    auto p = static_cast<size_t>(std::lower_bound(offsets_.begin(), offsets_.end(), begin) -
                                 offsets_.begin());
    if (offsets_[p] != begin || !std::binary_search(offsets_.begin(), offsets_.end(), end)) {
      invalid("gradients_ready range [" + std::to_string(begin) + ", " + std::to_string(end) +
              ") does not cover whole parameters");
    }
    for (; p < names_.size() && offsets_[p + 1] <= end; ++p) {
      if (offsets_[p + 1] == offsets_[p]) continue;  // empty: nothing to reduce
      if (ready_[p]) {
        invalid("parameter '" + names_[p] + "' was reported ready twice in one backward");
      }
      ready_[p] = true;
      --buckets_[bucket_of_[p]].unready;
    }
    if (sync_) launch_ready_buckets();
  }

  void finish_gradients() {
    require_setup("finish_gradients");
    if (!in_micro_batch_ || !sync_) {
      out_of_order(
          "finish_gradients without a sync micro-batch: begin the step's last micro-batch "
          "with sync = 1");
    }
    in_micro_batch_ = false;
    if (next_launch_ < buckets_.size()) {
      const std::string unreported = find_unused_parameters_ ? "" : unreported_parameters();
      if (!unreported.empty()) {
        // Leaves no request behind, so the instance can run the next step.
        wait_in_flight();
        throw Error(MESHRUN_INVALID_ARGUMENT,
                    "ddp: parameter " + unreported +
                        " got no gradient in the step's backward (never reported by "
                        "gradients_ready); if the model leaves parameters unused, set "
                        "find_unused_parameters = true");
      }
      // Unreported parameters keep their local gradient (zero when unused),
      // reduced with the rest of their bucket as PyTorch does.
      for (size_t b = next_launch_; b < buckets_.size(); ++b) buckets_[b].unready = 0;
      launch_ready_buckets();
    }
    wait_in_flight();
  }

  int64_t buffer_bytes() const {
    // Buckets are views of the host's gradient buffer: no staging copies.
    return 0;
  }

 private:
  struct Bucket {
    meshrun::ddp::Bucket plan;
    int64_t numel = 0;    // the view's shape; outlives the all-reduce
    int64_t unready = 0;  // non-empty parameters not yet reported
    meshrun_request* request = nullptr;
  };

  static void check_layout(const meshrun_strategy_setup& setup) {
    if (setup.num_parameters < 0) invalid("setup: num_parameters is negative");
    if (setup.parameter_offsets == nullptr) invalid("setup: parameter_offsets is NULL");
    if (setup.num_parameters > 0 && setup.parameter_names == nullptr) {
      invalid("setup: parameter_names is NULL");
    }
    if (setup.parameter_offsets[0] != 0) invalid("setup: parameter_offsets[0] must be 0");
    for (int64_t p = 0; p < setup.num_parameters; ++p) {
      if (setup.parameter_names[p] == nullptr) {
        invalid("setup: parameter_names[" + std::to_string(p) + "] is NULL");
      }
      if (setup.parameter_offsets[p + 1] < setup.parameter_offsets[p]) {
        invalid("setup: parameter_offsets decrease at parameter '" +
                std::string(setup.parameter_names[p]) + "'");
      }
    }
  }

  int64_t parameters_in(const Bucket& bucket) const {
    int64_t count = 0;
    for (auto p = static_cast<size_t>(bucket.plan.first_parameter);
         p < static_cast<size_t>(bucket.plan.end_parameter); ++p) {
      count += offsets_[p + 1] > offsets_[p] ? 1 : 0;
    }
    return count;
  }

  void require_setup(const char* call) const {
    if (comm_ == nullptr) out_of_order(std::string(call) + " before setup");
  }

  // Starts the all-reduce of every bucket that is complete, strictly in
  // bucket order: every rank must start its collectives in the same order,
  // and ranks see their gradients become ready in different orders, so a
  // complete bucket waits until those before it have started.
  void launch_ready_buckets() {
    for (; next_launch_ < buckets_.size() && buckets_[next_launch_].unready == 0; ++next_launch_) {
      Bucket& bucket = buckets_[next_launch_];
      DLTensor view = gradients_;
      view.byte_offset += static_cast<uint64_t>(bucket.plan.begin * kElementBytes);
      view.shape = &bucket.numel;
      view.strides = nullptr;
      throw_if_error(
          comm_->all_reduce(data_parallel_, &view, &view, MESHRUN_REDUCE_AVG, &bucket.request),
          "all_reduce of " + describe(next_launch_));
    }
  }

  // Waits for every bucket in flight, in launch order, releasing each
  // request; the first failure is thrown once all are released.
  void wait_in_flight() {
    meshrun_error* first_error = nullptr;
    size_t failed = 0;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (buckets_[b].request == nullptr) continue;
      meshrun_error* error = comm_->wait(buckets_[b].request, -1.0);
      comm_->request_destroy(buckets_[b].request);
      buckets_[b].request = nullptr;
      if (first_error == nullptr) {
        first_error = error;
        failed = b;
      } else {
        meshrun_error_release(error);
      }
    }
    throw_if_error(first_error, "all_reduce of " + describe(failed));
  }

  // With find_unused_parameters = false every parameter must be reported in
  // the sync backward, as PyTorch DDP requires: a missing one means the
  // model and the config disagree. Returns "'name' (and N more parameters)"
  // for the unreported ones, or "" when there are none.
  std::string unreported_parameters() const {
    std::string first;
    size_t missing = 0;
    for (size_t p = 0; p < names_.size(); ++p) {
      if (ready_[p] || offsets_[p + 1] == offsets_[p]) continue;
      if (missing++ == 0) first = names_[p];
    }
    if (missing == 0) return "";
    return "'" + first + "'" +
           (missing > 1 ? " (and " + std::to_string(missing - 1) + " more parameters)" : "");
  }

  std::string describe(size_t b) const {
    const meshrun::ddp::Bucket& plan = buckets_[b].plan;
    return "gradient bucket " + std::to_string(b) + " ('" +
           names_[static_cast<size_t>(plan.first_parameter)] + "' .. '" +
           names_[static_cast<size_t>(plan.end_parameter - 1)] + "')";
  }

  void log(int32_t level, const std::string& message) const {
    if (host_->log != nullptr) host_->log(host_->context, level, message.c_str());
  }

  const meshrun_host_services* host_;
  const meshrun_comm_api* comm_ = nullptr;  // non-NULL once set up
  meshrun_communicator* data_parallel_ = nullptr;
  DLTensor parameters_{};
  DLTensor gradients_{};
  std::vector<int64_t> offsets_;
  std::vector<std::string> names_;
  bool find_unused_parameters_ = false;

  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // per parameter
  std::vector<bool> ready_;        // per parameter, in this backward
  size_t next_launch_ = 0;         // the first bucket not yet started
  bool in_micro_batch_ = false;
  bool sync_ = false;
};

// Runs `body` on the instance, turning exceptions into errors.
template <class Body>
meshrun_error* on_instance(meshrun_plugin_instance* instance, Body&& body) noexcept {
  return meshrun::plugin::guard([&] {
    if (instance == nullptr) invalid("instance is NULL");
    body(*reinterpret_cast<Ddp*>(instance));
  });
}

meshrun_error* setup(meshrun_plugin_instance* instance, const meshrun_strategy_setup* setup) {
  return on_instance(instance, [&](Ddp& ddp) { ddp.setup(setup); });
}

meshrun_error* broadcast_parameters(meshrun_plugin_instance* instance) {
  return on_instance(instance, [&](Ddp& ddp) { ddp.broadcast_parameters(); });
}

meshrun_error* begin_micro_batch(meshrun_plugin_instance* instance, int32_t sync) {
  return on_instance(instance, [&](Ddp& ddp) { ddp.begin_micro_batch(sync != 0); });
}

meshrun_error* gradients_ready(meshrun_plugin_instance* instance, int64_t begin, int64_t end) {
  return on_instance(instance, [&](Ddp& ddp) { ddp.gradients_ready(begin, end); });
}

meshrun_error* finish_gradients(meshrun_plugin_instance* instance) {
  return on_instance(instance, [&](Ddp& ddp) { ddp.finish_gradients(); });
}

meshrun_error* memory(meshrun_plugin_instance* instance, meshrun_strategy_memory* out) {
  return on_instance(instance, [&](Ddp& ddp) {
    if (out == nullptr) invalid("memory: out is NULL");
    if (out->struct_size < MESHRUN_STRUCT_SIZE(meshrun_strategy_memory, buffers)) {
      invalid("memory: out->struct_size " + std::to_string(out->struct_size) + " is too small");
    }
    out->buffers = ddp.buffer_bytes();
  });
}

// Built field by field from a zeroed table, so fields appended by later ABI
// minors need no initializer here.
const meshrun_strategy_api kStrategyApi = [] {
  meshrun_strategy_api api{};
  api.struct_size = MESHRUN_STRATEGY_API_SIZE_1_2;
  api.mesh_family = MESHRUN_MESH_FAMILY_DDP;
  api.setup = &setup;
  api.broadcast_parameters = &broadcast_parameters;
  api.begin_micro_batch = &begin_micro_batch;
  api.gradients_ready = &gradients_ready;
  api.finish_gradients = &finish_gradients;
  api.memory = &memory;
  return api;
}();

const meshrun_plugin_api kApi = [] {
  meshrun_plugin_api api{};
  api.struct_size = sizeof(meshrun_plugin_api);
  api.abi_major = MESHRUN_ABI_VERSION_MAJOR;
  api.abi_minor = MESHRUN_ABI_VERSION_MINOR;
  api.kind = MESHRUN_PLUGIN_KIND_STRATEGY;
  api.name = "ddp";
  api.version = MESHRUN_PLUGIN_VERSION;
  api.description =
      "DDP: replicates parameters on every dp rank (broadcast from rank 0) and all-reduces "
      "(averages) float32 gradients in reverse-order buckets (bucket_cap_mb, first bucket "
      "1 MiB) as backward reports them ready, overlapping backward; deferred sync on non-final "
      "micro-batches; find_unused_parameters honoured; gradient_as_bucket_view, static_graph and "
      "broadcast_buffers accepted (buckets are always views, the bucket order is fixed, no "
      "buffers); no tp, pp, cp or ep";
  api.create = &meshrun::plugin::create_instance<Ddp>;
  api.destroy = &meshrun::plugin::destroy_instance<Ddp>;
  api.strategy = &kStrategyApi;
  return api;
}();

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
