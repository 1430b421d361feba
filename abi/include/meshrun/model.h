/*
 * meshrun/model.h — the model ABI (plugin kind "model", ABI 1.5; 1.7 adds experts;
 * 1.8 adds the description's "flops", 1.9 its "activations", 1.10 their
 * "float32" part, 1.11 its "unit_kinds"; 1.12 adds the hooks' parameter_bfloat16;
 * 1.14 the stage setup's device and compute stream).
 *
 * A model plugin (meshrun_model_llama.so, meshrun_model_gpt2.so, a
 * third-party one in C) is the compute of one model family: it declares the
 * parameters of a configured model and runs forward + loss and backward of
 * a micro-batch. It owns no parameter storage: at every unit boundary it
 * calls the host (meshrun_model_hooks), which hands it views of the unit's
 * parameters and gradients, so that any strategy can gather, reshard and
 * reduce them in between. `meshrun train` picks the model plugin named by
 * `model.model_type`, as it picks strategies by name.
 *
 * Objects, each created and destroyed explicitly:
 *
 *   plugin instance --model_create(config)--> meshrun_model (one architecture)
 *   meshrun_model   --stage_create(modules)--> meshrun_model_stage (compute)
 *
 * A stage computes a contiguous run of the model's modules: all of them
 * without pipeline parallelism, one pipeline stage's otherwise. Several
 * micro-batches may be in flight in a stage (pipeline schedules): forward(mb)
 * keeps what mb's backward needs until that backward (or discard) is done.
 *
 * The description. `describe` returns a JSON object (docs/model.md):
 *
 *   "config":     the resolved Hugging Face config.json of the model (every
 *                 key with its default applied; "model_type" and
 *                 "architectures" included), written beside exported weights
 *   "parameters": [{"name", "shape", "unit", "tp"?}], every parameter in the
 *                 order of the flat parameter layout (Hugging Face names);
 *                 "tp" is how the model computes it over tensor-parallel
 *                 ranks: "replicate" (the default), "shard(d)" (a rank holds
 *                 its 1/tp of dimension d) or "shard(d,b)" (its 1/tp of each
 *                 of b equal blocks of d). With tp > 1 the `parameter` hook
 *                 hands out the rank's piece, of the local shape
 *   "units":      unit names; the last is "root" and encloses the others,
 *                 whose layer units are in forward order (a strategy
 *                 shards per unit)
 *   "unit_kinds": optional (1.11), one per unit: "layer", "embedding",
 *                 "head" or "root" (the last, and only it). The
 *                 embedding's forward runs before the layers and the head's
 *                 (final norm, lm_head) after them, wherever "units" lists
 *                 them, at most one each; the root then holds what they
 *                 share (a tied embedding), possibly nothing. A pipeline
 *                 split balances and activation checkpointing lists the
 *                 layer units only. Absent: every unit but the root is a
 *                 layer
 *   "modules":    [{"name", "parameters": [names], "group"?}], the modules a
 *                 pipeline split may cut between, in forward order; a module
 *                 lists every parameter it uses (a tied lm_head lists the
 *                 embedding), and modules sharing a non-empty "group" stay
 *                 on one stage
 *   "vocab_size": token ids must lie in [0, vocab_size)
 *   "max_seq_len": the longest sequence it takes, or null for no limit
 *   "num_layers_key": the [model] key of the layer count, for messages
 *   "sequence_parallel": true when the model computes sequence parallelism
 *                 (the plan's "sequence_parallel": its residual stream
 *                 between the tensor-parallel blocks holds the rank's 1/tp
 *                 of the rows); absent means false, and the host refuses
 *                 distributed.sequence_parallel for it
 *   "devices":    where the model computes: a non-empty array of "cpu" and
 *                 "cuda"; absent means ["cpu"]. The host refuses a CUDA run
 *                 (dist_env.backend "nccl") of a model without "cuda"
 *   "tensor_parallel": false when the model computes no tensor parallelism
 *                 at all (a mixture of experts computing its experts whole);
 *                 absent means true. The host then refuses
 *                 distributed.tp_size > 1 for it when it plans
 *   "tp_blocks":  [{"name", "modules": {pattern: style}}], optional: the
 *                 groups of modules the model computes over tp together or
 *                 replicates together, as distributed.tp_plan chooses. A
 *                 module is a parameter's name without its last component;
 *                 a pattern's '*' stands for one name component
 *                 ("model.layers.*.mlp.up_proj"); style is the module's
 *                 torch style when parallel, "colwise" or "rowwise". Every
 *                 parameter with a "tp" other than "replicate" is in exactly
 *                 one block. Absent: the model computes one layout only, and
 *                 the host refuses a tp_plan for it
 *   "autocast_dtypes": the dtypes its matmuls can compute in, e.g.
 *                 ["bfloat16"] (the plan's "autocast_dtype": each matmul's
 *                 operands in that dtype, float32 sums). The host sets
 *                 the plan's from distributed.autocast_dtype, or from
 *                 fsdp2's mp_policy.param_dtype when listed here; absent
 *                 means none, and the host refuses
 *                 distributed.autocast_dtype for it
 *   "unit_class": the Hugging Face class of its layer units, as its
 *                 _no_split_modules names it ("LlamaDecoderLayer");
 *                 optional: distributed.megatron_fsdp_unit_modules may name
 *                 it and nothing else
 *   "experts":    {"count", "top_k"}, present in a mixture-of-experts
 *                 model: its experts per layer and experts per token. Each
 *                 expert's parameters say "expert": their expert's number;
 *                 with ep_size > 1 a stage holds its own experts' only
 *                 (below), and the host refuses ep_size > 1 without it
 *   "flops":      {"matmul_parameters", "attention": {"layers", "width"}},
 *                 optional (1.8): what a token costs, for the metrics'
 *                 flops_per_s and mfu: the weights it meets in matmuls
 *                 (every linear and the lm_head; a mixture of experts'
 *                 top_k experts only; not an embedding lookup), and the
 *                 attention layers with their query width (heads x
 *                 head_dim). The host counts 6 x matmul_parameters + 12 x
 *                 layers x width x seq_len FLOPs per trained token; absent,
 *                 6 x every parameter. Its optional "gemms" (1.11):
 *                 [{"k", "n", "count", "rows"?, "tp"?}], those matmuls as
 *                 the forward runs them: rows x k times k x n, count times,
 *                 on the share rows (0, 1] of a microbatch's rows (default
 *                 1), "tp" "k" or "n" for the dimension split over tp
 *                 ranks; k x n x count x rows summed must equal
 *                 matmul_parameters (the host refuses it otherwise). The
 *                 estimate times them on cpu-this-machine
 *   "activations": {"layer": {"whole", "tp_split"}, "elementwise": {...},
 *                 "stream", "head": {...}}, optional (1.9): the
 *                 elements the forward keeps for the backward per token of
 *                 a microbatch, for `meshrun plan --estimate`: a layer's
 *                 (nothing recomputed), the part of those selective
 *                 checkpointing recomputes, a layer's input (the residual
 *                 stream the stage keeps), the head's; "whole" on every tp
 *                 rank, "tp_split" divided over them. Absent, the estimate
 *                 says the activations are not described. With 1.10's
 *                 optional "float32": {"layer", "elementwise", "head"},
 *                 the model keeps all but those elements in bfloat16 when
 *                 the plan's autocast_dtype is "bfloat16" (norm
 *                 statistics, log-sum-exps and the loss's softmax stay
 *                 float32; the stream always does); each at most its
 *                 whole. Absent, every element is float32
 *   "context_parallel": {"heads", "kv_heads"}, present when the model
 *                 computes context parallelism (below): its attention and
 *                 key/value heads, which cp_ulysses_degree must divide on
 *                 every tp rank; absent, the host refuses cp_size > 1
 *
 * Units in hook calls are indices into "units"; parameters are indices
 * into "parameters".
 *
 * Tensor parallelism. The stage computes over setup->tp with setup->comm
 * (the host's table over the backend: it counts the bytes the model sends
 * and refuses `split`); init_parameter still fills the full tensor, and the
 * host keeps the rank's piece. The plan (setup->plan_json, "parameters")
 * gives each placement: the described one, or "replicate" for every
 * parameter of a block the tp_plan replicates, which the stage then
 * computes whole on every rank; a stage refuses any other.
 *
 * Context parallelism. With cp_size > 1 the stage computes over setup->cp
 * (size cp): every forward is handed the whole micro-batch ([batch,
 * seq_len] tokens and targets, the same on each cp rank), and the stage
 * computes its own rows of each sequence only. The plan's
 * "context_parallel" ({"size", "ring_degree", "ulysses_degree",
 * "chunks"}) says how: each sequence cut into chunks = 2 cp equal pieces,
 * cp rank i holding pieces i and 2 cp - 1 - i, and attention shared by
 * ring_degree x ulysses_degree ranks. set_shape still takes the whole
 * seq_len; the hidden states between stages hold the rank's rows. The loss
 * forward returns is the mean over all rows of the micro-batch (summed
 * over cp), while backward accumulates the gradients of the mean over the
 * rank's own rows: the host averages gradients over dp_shard_cp, which
 * makes them the micro-batch's.
 *
 * Expert parallelism. With ep_size > 1 the stage computes over setup->ep
 * (size ep): expert e of the description's "experts" count E lives on ep
 * rank e * ep / E, and the host hands out (and the `parameter` hook
 * serves) the parameters of this rank's experts only. Each rank routes its
 * own tokens; the stage sends them to their experts' ranks and gets the
 * outputs back (the comm table's all_to_all). The gradients an expert
 * accumulates are those of every token it computed, each of the mean over
 * its own rank's rows: the host averages them over ep_shard and divides by
 * ep, which makes them the step's.
 *
 * Hooks. During forward, backward, backward_input and backward_weight a
 * stage calls, for every unit u one of whose parameters it holds:
 *
 *   forward:   pre_forward(u, input)  [u's compute]  post_forward(u, output)
 *   backward:  pre_backward(u)        [u's compute]  post_backward(u)
 *
 * with the root's pre_ first and post_ last (it encloses the other units;
 * a stage holding the embedding or the head unit calls the root's hooks
 * even when the root holds no parameter), and gets u's parameter and gradient views with
 * `parameter` after pre_ and uses them only until post_. The host lays the parameters of one unit
 * out one after another in description order, values in one block and gradients in another, so a
 * model may treat adjacent parameters as one tensor (a fused q/k/v projection). In a backward,
 * gradient_ready(p) follows the moment the gradient of p is final for this backward, before
 * post_backward of p's unit; every parameter of the stage is announced once
 * per backward (over backward_input and backward_weight together when the
 * backward is split, each of which brackets the units it touches with
 * pre_backward / post_backward). A hook that returns an error aborts the
 * call: the stage returns that same error object (its ownership passes back
 * to the host) and the micro-batch is dropped.
 *
 * Errors: INVALID_ARGUMENT (NULL, a bad shape or config value: messages of
 * model_create begin with the dotted config key, "model.hidden_size: ...",
 * so the host can point at its place in the config file), OUT_OF_RANGE (a
 * token or target outside the vocabulary), FAILED_PRECONDITION (calls out
 * of order: a backward without its forward, a microbatch already in flight,
 * set_shape while microbatches are in flight), INTERNAL.
 */
#ifndef MESHRUN_MODEL_H_
#define MESHRUN_MODEL_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#include "meshrun/comm.h"
#include "meshrun/error.h"
#include "meshrun/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Declared again (C11 allows it) for when comm.h is still being read. */
typedef struct meshrun_communicator meshrun_communicator;

/* One configured model (an architecture); opaque, owned by the plugin. */
typedef struct meshrun_model meshrun_model;
/* The compute of some of a model's modules; opaque, owned by the plugin. */
typedef struct meshrun_model_stage meshrun_model_stage;

/* The host's side of a stage, called by the model at unit boundaries (see
 * the top of this header for the order). Borrowed by stage_create until
 * stage_destroy. Every function receives `context` first. */
typedef struct meshrun_model_hooks {
  size_t struct_size;
  void* context;
  /* Before unit `unit`'s forward. `input` is the unit's input hidden states
   * (float32, in the model's own buffer), which the host may rewrite in
   * place (a mixed-precision policy's cast), or NULL for a unit without a
   * single input tensor (the root). */
  meshrun_error* (*pre_forward)(void* context, int32_t unit, DLTensor* input);
  /* After unit `unit`'s forward; `output` as `input` above. */
  meshrun_error* (*post_forward)(void* context, int32_t unit, DLTensor* output);
  /* Before and after unit `unit`'s part of a backward. */
  meshrun_error* (*pre_backward)(void* context, int32_t unit);
  meshrun_error* (*post_backward)(void* context, int32_t unit);
  /* The gradient of parameter `parameter` is final for this backward; a
   * strategy may start reducing it. */
  meshrun_error* (*gradient_ready)(void* context, int64_t parameter);
  /* Fills `value` and `gradient` with views of parameter `parameter`:
   * float32, on the stage's device (ABI 1.14; host memory before),
   * contiguous, the described shape (a tp rank's piece of it
   * under tensor parallelism); the shape arrays and the
   * memory are the host's, valid until the post_ hook of the parameter's
   * unit. `gradient->data` is NULL outside a backward; gradients accumulate
   * (+=) over a step's micro-batches. Either pointer may be NULL.
   * OUT_OF_RANGE for a parameter the stage does not hold,
   * FAILED_PRECONDITION outside its unit's pre_ / post_ hooks. */
  meshrun_error* (*parameter)(void* context, int64_t parameter, DLTensor* value,
                              DLTensor* gradient);
  const meshrun_extension* extensions;

  /* ---- ABI 1.12 (read it only when struct_size covers it) ---- */

  /* Fills `value` with a bfloat16 view of parameter `parameter`'s values
   * when the host holds one (a strategy that gathers in bfloat16 keeps what
   * it received): the same numbers as `parameter`'s float32 view, each
   * exactly a bfloat16, laid out alike (adjacent parameters of a unit
   * adjacent), so a bfloat16 matmul reads it instead of rounding again.
   * `value->data` is NULL when the host holds none. Memory and validity as
   * `parameter`'s; errors as `parameter`'s. */
  meshrun_error* (*parameter_bfloat16)(void* context, int64_t parameter, DLTensor* value);
} meshrun_model_hooks;

/* What a stage computes and with whom. Borrowed for the stage_create call,
 * but `hooks`, `comm` and the communicators stay valid until stage_destroy. */
typedef struct meshrun_model_stage_setup {
  size_t struct_size;
  /* The stage's modules: names from the description's "modules", a
   * contiguous run of them in model order. */
  int64_t num_modules;
  const char* const* modules;
  const meshrun_model_hooks* hooks;
  /* Communicators of the mesh axes a model computes over: tensor parallel,
   * context parallel and expert parallel (size 1 when unused; ep is NULL
   * without an MoE mesh), with the comm backend's table. */
  const meshrun_comm_api* comm;
  meshrun_communicator* tp;
  meshrun_communicator* cp;
  meshrun_communicator* ep;
  /* The run's plan of the model (docs/plan.md: tensor-parallel placement,
   * activation checkpointing) and the [distributed] config, as JSON
   * objects. */
  const char* plan_json;
  const char* options_json;
  const meshrun_extension* extensions;

  /* ---- ABI 1.14 (read only when struct_size covers it; absent: the CPU) ---- */

  /* Where the stage computes: every tensor the host hands it (tokens,
   * targets, hidden states and their gradients, the hooks' parameter views)
   * lives on this device, kDLCPU (host memory) or kDLCUDA with the rank's
   * GPU as device_id. A stage that cannot compute there fails stage_create
   * with UNIMPLEMENTED naming the device; one given a tensor on another
   * device fails the call with INVALID_ARGUMENT naming the tensor and both
   * devices. */
  DLDevice device;
  /* On a CUDA device, the stream (cudaStream_t; NULL: the legacy default
   * stream) tensors are handed over on, as DLPack's __dlpack__(stream=...)
   * and meshrun/strategy.h state it: the host's writes of what it hands a
   * call (tokens, input, grad_output, parameter views after their pre_
   * hook) are enqueued on it, not necessarily done; the stage enqueues its
   * kernels on it (or makes it wait for its own streams), so what a call
   * writes (output, grad_input, gradients, the hidden states a hook sees)
   * is ready for the work the host enqueues on it after the call, and it
   * waits on the host only to return a value (forward's loss). The host
   * sets the tp, cp and ep communicators' stream (meshrun/comm.h
   * set_stream) to it, so the collectives the stage starts over them are
   * ordered with its kernels. Ignored on the CPU. Borrowed until
   * stage_destroy. */
  void* compute_stream;
} meshrun_model_stage_setup;

/* The model plugin's table (meshrun_plugin_api.model). */
struct meshrun_model_api {
  size_t struct_size;
  const char* model_type; /* the Hugging Face model_type it computes, e.g. "gpt2" */
  /* The [model] keys it reads, NULL-terminated (besides model_type,
   * torch_dtype and checkpoint, which the host reads): the host refuses
   * any other key before creating a model. */
  const char* const* config_keys;
  const meshrun_extension* extensions;

  /* Makes a model of the [model] config in `config_json` (a JSON object of
   * the keys the user set, borrowed for the call; absent keys take the
   * plugin's defaults). On success *out is owned by the caller (destroy
   * with model_destroy after its stages). Errors: INVALID_ARGUMENT with the
   * message starting "model.<key>: ". */
  meshrun_error* (*model_create)(meshrun_plugin_instance* instance, const char* config_json,
                                 meshrun_model** out);
  /* Destroys a model; NULL is accepted. */
  void (*model_destroy)(meshrun_model* model);
  /* The description (top of this header) as a NUL-terminated JSON object,
   * allocated with the `allocate` of the host services given to `create`;
   * the caller frees it with their `deallocate`. */
  meshrun_error* (*describe)(meshrun_model* model, char** out_json);
  /* Fills `value` (float32, contiguous, the parameter's described shape)
   * with parameter `parameter`'s initial values for `seed`. The values do
   * not depend on which other parameters are initialized, or in what
   * order, so a host may initialize only what it holds. */
  meshrun_error* (*init_parameter)(meshrun_model* model, uint64_t seed, int64_t parameter,
                                   DLTensor* value);

  /* Makes a stage of `model` over `setup` (see meshrun_model_stage_setup).
   * Errors: INVALID_ARGUMENT for modules that are unknown, out of order,
   * not contiguous, or that the model cannot compute apart (naming them).
   * On success *out is owned by the caller. */
  meshrun_error* (*stage_create)(meshrun_model* model, const meshrun_model_stage_setup* setup,
                                 meshrun_model_stage** out);
  /* Destroys a stage, dropping microbatches in flight; NULL is accepted. */
  void (*stage_destroy)(meshrun_model_stage* stage);
  /* The shape [batch, seq_len] of the micro-batches to come. Writes the
   * float32 elements of the hidden states entering the stage (0 on the
   * first stage, which reads tokens) and leaving it (0 on the last, which
   * computes the loss). FAILED_PRECONDITION while microbatches are in
   * flight and the shape changes. */
  meshrun_error* (*set_shape)(meshrun_model_stage* stage, int64_t batch, int64_t seq_len,
                              int64_t* out_input_numel, int64_t* out_output_numel);
  /* F: the forward of microbatch `microbatch`. `tokens` and `targets` are
   * int32 [batch, seq_len]; the first stage reads tokens, the last targets.
   * `input` (input_numel float32, NULL on the first stage) is read during
   * the call; `output` (output_numel float32, NULL on the last stage) is
   * written. *out_loss receives the mean natural-log cross-entropy over the
   * micro-batch's targets on the last stage, else 0. */
  meshrun_error* (*forward)(meshrun_model_stage* stage, int32_t microbatch, const DLTensor* tokens,
                            const DLTensor* targets, const DLTensor* input, DLTensor* output,
                            double* out_loss);
  /* B: accumulates (+=) the microbatch's parameter gradients and writes
   * `grad_input` (input_numel, NULL on the first stage) from `grad_output`
   * (output_numel, NULL on the last stage) or, on the last stage, from
   * loss_scale * the loss (loss_scale = d objective / d mean loss, e.g.
   * 1/m for the mean over m micro-batches). Frees the microbatch's state. */
  meshrun_error* (*backward)(meshrun_model_stage* stage, int32_t microbatch, float loss_scale,
                             const DLTensor* grad_output, DLTensor* grad_input);
  /* I and W, the two halves of a split backward for zero-bubble schedules:
   * backward_input writes grad_input as backward does and keeps what the
   * weight gradients need; backward_weight then accumulates them and frees
   * the microbatch. Both NULL in a model that cannot split its backward;
   * the host then refuses such schedules before the run starts. */
  meshrun_error* (*backward_input)(meshrun_model_stage* stage, int32_t microbatch, float loss_scale,
                                   const DLTensor* grad_output, DLTensor* grad_input);
  meshrun_error* (*backward_weight)(meshrun_model_stage* stage, int32_t microbatch);
  /* Drops what the microbatch's forward kept, without a backward (a forward
   * that only evaluates). FAILED_PRECONDITION when it is not in flight. */
  meshrun_error* (*discard)(meshrun_model_stage* stage, int32_t microbatch);
  /* Bytes the stage keeps for the microbatches in flight now. */
  meshrun_error* (*activation_bytes)(meshrun_model_stage* stage, int64_t* out_bytes);

  /* ---- ABI 1.7 (test with MESHRUN_HAS_FIELD) ---- */

  /* A mixture-of-experts stage's router statistics since the last call,
   * which then start again: a JSON object {"aux_loss": the sum over the
   * backwards of each micro-batch's load-balancing loss (the mean over the
   * model's layers: a stage adds its own layers' share), "expert_tokens":
   * [per expert, the slots of this rank's tokens routed to it, summed over
   * the stage's layers]}, allocated with the host's `allocate`. NULL in a
   * model without experts. */
  meshrun_error* (*take_statistics)(meshrun_model_stage* stage, char** out_json);
};

/* The size of the ABI 1.5 model table, the first: the least a host reads. */
#define MESHRUN_MODEL_API_SIZE_1_5 MESHRUN_STRUCT_SIZE(meshrun_model_api, activation_bytes)
/* The size of the ABI 1.7 model table, with take_statistics. */
#define MESHRUN_MODEL_API_SIZE_1_7 MESHRUN_STRUCT_SIZE(meshrun_model_api, take_statistics)
/* The size of the ABI 1.5 hooks and stage setup. */
#define MESHRUN_MODEL_HOOKS_SIZE_1_5 MESHRUN_STRUCT_SIZE(meshrun_model_hooks, extensions)
/* The size of the ABI 1.12 hooks, with parameter_bfloat16. */
#define MESHRUN_MODEL_HOOKS_SIZE_1_12 MESHRUN_STRUCT_SIZE(meshrun_model_hooks, parameter_bfloat16)
#define MESHRUN_MODEL_STAGE_SETUP_SIZE_1_5 \
  MESHRUN_STRUCT_SIZE(meshrun_model_stage_setup, extensions)
/* The size of the ABI 1.14 stage setup, with device and compute_stream. */
#define MESHRUN_MODEL_STAGE_SETUP_SIZE_1_14 \
  MESHRUN_STRUCT_SIZE(meshrun_model_stage_setup, compute_stream)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_MODEL_H_ */
