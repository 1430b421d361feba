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
//
// On a GPU (ABI 1.13) a bucket's all-reduce runs on the comm stream after
// the host's compute enqueued before the gradients_ready call that completed
// it, and the compute stream waits for the all-reduces at finish_gradients.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "buckets.hpp"
#include "common/device.hpp"
#include "common/errors.hpp"
#include "common/options.hpp"
#include "common/setup_checks.hpp"
#include "common/table.hpp"

namespace {

using meshrun::strategies::invalid;
using meshrun::strategies::out_of_order;
using meshrun::strategies::throw_if_error;

constexpr int64_t kElementBytes = sizeof(float);
constexpr double kBytesPerMb = 1024.0 * 1024.0;

// The DDPConfig keys of the [distributed] object this strategy reads.
struct Options {
  double bucket_cap_mb = meshrun::ddp::kDefaultBucketCapMb;
  bool find_unused_parameters = false;
};

Options parse_options(const char* options_json) {
  const meshrun::strategies::Json json = meshrun::strategies::parse_options(options_json);
  const meshrun::strategies::OptionReader options(json);
  Options parsed;
  // AutoModel's bucket_cap_mb = None means PyTorch's default.
  parsed.bucket_cap_mb =
      options.positive_number("bucket_cap_mb").value_or(meshrun::ddp::kDefaultBucketCapMb);
  parsed.find_unused_parameters = options.boolean("find_unused_parameters", false);
  // Read only to check their type: the host's gradients are already one flat
  // buffer whose ranges are the buckets, so gradient_as_bucket_view = true
  // holds as it is and false would only add a copy nobody can observe; the
  // bucket order is fixed, which is what static_graph promises; the host's
  // models have no buffers to broadcast.
  for (const char* key : {"gradient_as_bucket_view", "static_graph", "broadcast_buffers"}) {
    options.boolean(key, false);
  }
  return parsed;
}

class Ddp {
 public:
  static constexpr const char* kName = "ddp";

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
    meshrun::strategies::check_setup(
        setup, MESHRUN_STRUCT_SIZE(meshrun_strategy_setup, options_json), "1.2");
    const Options options = parse_options(setup->options_json);
    const int64_t numel = setup->parameter_offsets[setup->num_parameters];
    for (const auto& [tensor, name] : {std::pair{&setup->parameters, "setup: parameters"},
                                       std::pair{&setup->gradients, "setup: gradients"}}) {
      meshrun::strategies::check_flat_float32(*tensor, name, numel, setup->comm->device_type);
    }

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
    device_ = meshrun::strategies::make_device(*setup);
    data_parallel_ = setup->data_parallel;
    comm_ = setup->comm;
    log(MESHRUN_LOG_DEBUG, "ddp: " + std::to_string(buckets_.size()) + " gradient buckets over " +
                               std::to_string(names_.size()) + " parameters, bucket_cap_mb " +
                               std::to_string(options.bucket_cap_mb));
  }

  void broadcast_parameters() {
    require_setup("broadcast_parameters");
    if (in_micro_batch_) out_of_order("broadcast_parameters during a micro-batch");
    device_->comm_follows_compute();
    throw_if_error(comm_->broadcast(data_parallel_, &parameters_, 0, nullptr),
                   "broadcast of the parameters from data-parallel rank 0");
    device_->compute_follows_comm();
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
    for (size_t p = meshrun::strategies::first_parameter_of_range(offsets_, begin, end);
         p < names_.size() && offsets_[p + 1] <= end; ++p) {
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
        invalid("parameter " + unreported +
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
    device_->compute_follows_comm();
  }

  void memory(meshrun_strategy_memory* out) const {
    // Buckets are views of the host's gradient buffer: no staging copies.
    meshrun::strategies::write_memory(out, 0, 0, 0);
  }

  // Every rank updates every parameter and holds no buffers (see memory).
  void plan_memory(const meshrun_strategy_plan_input* input,
                   meshrun_strategy_memory_plan* out) const {
    const meshrun_strategy_setup setup = meshrun::strategies::setup_of(input);
    parse_options(setup.options_json);
    meshrun::strategies::write_memory_plan(out, setup.parameter_offsets[setup.num_parameters], 0);
  }

 private:
  struct Bucket {
    meshrun::ddp::Bucket plan;
    int64_t numel = 0;    // the view's shape; outlives the all-reduce
    int64_t unready = 0;  // non-empty parameters not yet reported
    meshrun_request* request = nullptr;
  };

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
    if (next_launch_ < buckets_.size() && buckets_[next_launch_].unready == 0) {
      device_->comm_follows_compute();
    }
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
  std::unique_ptr<meshrun::strategies::Device> device_;  // orders the streams on a GPU
  const meshrun_comm_api* comm_ = nullptr;               // non-NULL once set up
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

const meshrun_strategy_api kStrategyApi =
    meshrun::strategies::replicated_strategy_table<Ddp>(MESHRUN_MESH_FAMILY_DDP);

const meshrun_plugin_api kApi = meshrun::strategies::strategy_plugin_table<Ddp>(
    Ddp::kName, MESHRUN_PLUGIN_VERSION,
    "DDP: replicates parameters on every dp rank (broadcast from rank 0) and all-reduces "
    "(averages) float32 gradients in reverse-order buckets (bucket_cap_mb, first bucket "
    "1 MiB) as backward reports them ready, overlapping backward; deferred sync on non-final "
    "micro-batches; find_unused_parameters honoured; gradient_as_bucket_view, static_graph and "
    "broadcast_buffers accepted (buckets are always views, the bucket order is fixed, no "
    "buffers); no tp, pp, cp or ep",
    &kStrategyApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
