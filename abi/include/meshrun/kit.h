/*
 * meshrun/kit.h — the model kit (kit ABI 1.2): a decoder-only model
 * composed from meshrun's layers, as a model plugin (meshrun/model.h).
 *
 * A plugin author writes the block structure and the config reading; the
 * kit (libmeshrun_kit.so, which the plugin links; CMake target meshrun::kit)
 * computes everything else with the layers the shipped models use: the
 * forward and the backward (derived from the forward's list), the
 * parameters in Hugging Face's names and their initialization, units and
 * pipeline modules, tensor parallelism (column/row-parallel projections,
 * vocabulary-parallel embedding and loss), context parallelism (ring and
 * Ulysses attention), activation checkpointing (full and selective),
 * zero-bubble split backwards, bfloat16 matmuls, and the description the
 * host plans and estimates with. docs/model.md has a worked example.
 *
 * The model (module names: the defaults, and the spec field that renames):
 *
 *   x = embed_tokens[tokens]                       "model.embed_tokens"  embedding_name
 *       [+ wpe[positions]]                         position_embedding_name
 *   N x decoder layer: the ops of `ops`            "model.layers.<n>"    layers_name
 *   final norm (RMSNorm or LayerNorm)              "model.norm"          final_norm_name
 *   logits = lm_head(norm) [+ bias]; mean cross-entropy against targets
 *
 * A decoder layer is a list of ops over named [tokens, hidden_size]
 * tensors: "x" is the layer's input, each op writes one new tensor, and the
 * op that writes "out" is the last. The backward runs the list in reverse,
 * summing the gradients of a tensor read by several ops. A Llama layer:
 *
 *   {RMSNORM,   "input_layernorm",          "x",  NULL, "n1"},
 *   {ATTENTION, "self_attn",                "n1", NULL, "a"},
 *   {ADD,       NULL,                       "x",  "a",  "h"},
 *   {RMSNORM,   "post_attention_layernorm", "h",  NULL, "n2"},
 *   {SWIGLU_MLP,"mlp",                      "n2", NULL, "m"},
 *   {ADD,       NULL,                       "h",  "m",  "out"}
 *
 * Parameters of an op named M in layer n (prefix P = "<layers_name>.<n>.M."),
 * with MESHRUN_KIT_LINEAR projections (torch.nn.Linear, weights [out, in]):
 *   RMSNORM     P weight [H]
 *   LAYERNORM   P weight [H], P bias [H]
 *   ATTENTION   P q_proj, k_proj, v_proj .weight [heads*d | kv*d, H],
 *               their .bias with MESHRUN_KIT_BIAS_IN; P <output>.weight
 *               [H, heads*d] (<output> = attention_output_name), its .bias
 *               with MESHRUN_KIT_BIAS_OUT. Causal grouped-query attention,
 *               rotary embeddings on the first partial_rotary_factor of each
 *               head (Hugging Face's rotate_half convention), d = H / heads
 *   SWIGLU_MLP  P gate_proj, up_proj .weight [I, H], P down_proj.weight
 *               [H, I]; biases as above; down(silu(gate(x)) * up(x))
 *   GELU_MLP    P fc1.weight [I, H], P fc2.weight [H, I]; biases as above;
 *               fc2(gelu_tanh(fc1(x)))
 *   MOE_MLP     P gate.weight [E, H] (the router), then per expert j
 *               P experts.<j>.w1.weight [I, H], w3.weight [I, H], w2.weight
 *               [H, I] (Mixtral's names; E = num_local_experts, each
 *               expert's width I = intermediate_size): a sparse mixture of
 *               SwiGLU experts. Each token goes to the num_experts_per_tok
 *               experts of highest router softmax (ties to the lower
 *               expert), weighted by their probabilities renormalized over
 *               those, w2(silu(w1 x) * w3 x); dropless. Hugging Face's
 *               load-balancing loss on the layer's tokens, times
 *               router_aux_loss_coef / num_hidden_layers, joins the
 *               objective. The experts spread over the ep ranks
 *               (distributed.ep_size). No bias flags; a model with a MOE_MLP
 *               computes no tensor or context parallelism (kit 1.2)
 *   ADD         none; writes input + input2
 * With MESHRUN_KIT_CONV1D projections (GPT-2's Conv1D, weights [in, out],
 * each bias right after its weight when the flags ask for it):
 *   ATTENTION   P c_attn.weight [H, 3 * heads*d] (q, k and v fused; no
 *               grouped key/value heads), P c_proj.weight [heads*d, H]
 *               (<output> = attention_output_name, default "c_proj")
 *   GELU_MLP    P c_fc.weight [H, I], P c_proj.weight [I, H]
 *   (SWIGLU_MLP and MOE_MLP are refused.)
 * Positions: rotary embeddings on the first partial_rotary_factor of each
 * head's channels (Hugging Face's rotate_half convention); or, when
 * position_embedding_name is set, a learned table
 * <position_embedding_name>.weight [max_position_embeddings, H] whose row t
 * is added to the embedding of the sequence's token t, and no rotary.
 * Matrices start as normal(0, initializer_range), the output projections
 * (o_proj/c_proj, down_proj, fc2) divided by sqrt(2 num_hidden_layers) when
 * scale_output_init is set (GPT-2's); norm weights as 1, biases as 0.
 *
 * Tensor parallelism places q/k/v (c_attn), gate/up and fc1 (c_fc)
 * column-wise and the output projections row-wise (Megatron-LM's layout, as
 * AutoModel's plans do), the token embedding and lm_head
 * vocabulary-parallel, the position embedding replicated. Sequence
 * parallelism (distributed.sequence_parallel) is computed when every
 * attention and MLP reads the output of a norm that only attention and MLPs
 * read; `meshrun plan` refuses it otherwise, saying which op stands in the
 * way.
 *
 * Thread safety: the functions below may be called from any thread; a
 * model and its stages are used by one thread at a time, as model.h says.
 *
 * Errors: every function that returns a meshrun_error* returns NULL or an
 * error object the caller releases (meshrun/error.h). A composition that does not line up is
 * refused when the model is made (so at `meshrun plan`), INVALID_ARGUMENT
 * with a message naming the decoder layer's op ("kit: layer op 3 'mlp'
 * reads 'n3', which no earlier op writes").
 */
#ifndef MESHRUN_KIT_H_
#define MESHRUN_KIT_H_

#include <stddef.h>
#include <stdint.h>

#include "meshrun/error.h"
#include "meshrun/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kit's own ABI version, with the rules of meshrun/error.h: the minor
 * grows when something is added at the end of a struct. */
#define MESHRUN_KIT_VERSION_MAJOR 1
#define MESHRUN_KIT_VERSION_MINOR 2

/* Exported by libmeshrun_kit.so; hidden in a plugin that includes this. */
#if defined(MESHRUN_KIT_BUILDING) && defined(__GNUC__)
#define MESHRUN_KIT_EXPORT __attribute__((visibility("default")))
#else
#define MESHRUN_KIT_EXPORT
#endif

/* What an op computes (meshrun_kit_op.op). */
#define MESHRUN_KIT_RMSNORM 1
#define MESHRUN_KIT_LAYERNORM 2
#define MESHRUN_KIT_ATTENTION 3
#define MESHRUN_KIT_SWIGLU_MLP 4
#define MESHRUN_KIT_GELU_MLP 5
#define MESHRUN_KIT_ADD 6
#define MESHRUN_KIT_MOE_MLP 7 /* kit 1.2 */

/* Biases of an attention or MLP op (meshrun_kit_op.flags): on its input
 * projections (q, k, v; gate, up; fc1) and on its output projection. */
#define MESHRUN_KIT_BIAS_IN 1
#define MESHRUN_KIT_BIAS_OUT 2

/* How projections are stored (meshrun_kit_model_spec.projections, 1.1). */
#define MESHRUN_KIT_LINEAR 0 /* torch.nn.Linear: [out, in], q/k/v apart (the default) */
#define MESHRUN_KIT_CONV1D 1 /* GPT-2's Conv1D: [in, out], q/k/v fused as c_attn */

/* One op of the decoder layer. Strings are borrowed for the compose call. */
typedef struct meshrun_kit_op {
  int32_t op;         /* MESHRUN_KIT_* */
  int32_t flags;      /* MESHRUN_KIT_BIAS_*: attention and MLP ops only */
  const char* name;   /* its module's name in the layer ("self_attn"); NULL for ADD */
  const char* input;  /* the tensor it reads: "x" or an earlier op's output */
  const char* input2; /* ADD's second addend; NULL for the others */
  const char* output; /* the tensor it writes, new; "out" for the last op */
} meshrun_kit_op;

/* A model: what `compose` fills in. The kit zeroes it and sets struct_size
 * and the defaults noted before the call. Its strings and arrays must stay
 * valid until meshrun_kit_model_create returns (static storage, as a
 * plugin's tables are); the kit copies them. */
typedef struct meshrun_kit_model_spec {
  size_t struct_size;
  /* Sizes, Hugging Face's names. */
  int64_t vocab_size;
  int64_t hidden_size;
  int64_t intermediate_size;
  int64_t num_hidden_layers;
  int64_t num_attention_heads;
  int64_t num_key_value_heads;
  double norm_eps;                   /* every norm's epsilon */
  double rope_theta;                 /* default 10000 */
  double partial_rotary_factor;      /* of each head's channels rotated, (0, 1]; default 1 */
  int32_t tie_word_embeddings;       /* lm_head is embed_tokens */
  int32_t lm_head_bias;              /* lm_head.bias [vocab]; not with tied embeddings */
  int32_t final_norm;                /* MESHRUN_KIT_RMSNORM (default) or MESHRUN_KIT_LAYERNORM */
  const char* final_norm_name;       /* default "model.norm" */
  const char* attention_output_name; /* default "o_proj" */
  /* The decoder layer. */
  int64_t num_ops;
  const meshrun_kit_op* ops;
  /* Hugging Face: the architecture ("Qwen2ForCausalLM"), the decoder
   * layer's class ("Qwen2DecoderLayer", for megatron_fsdp_unit_modules),
   * and the config.json keys besides model_type, architectures and the
   * sizes above with the values the model takes when [model] leaves them
   * unset, as a JSON object ("{\"rms_norm_eps\": 1e-06}") or NULL. The
   * exported config.json holds these, then every [model] key the user set,
   * then the sizes as the model was made with them (size_keys below). */
  const char* architecture;
  const char* layer_class;
  const char* config_json;
  /* Kit 1.1: models named and laid out otherwise than Llama. A plugin built
   * against 1.0 leaves them at the defaults; one that sets them checks
   * MESHRUN_HAS_FIELD(meshrun_kit_model_spec, spec, <field>) first, as a kit
   * 1.0 library hands it a smaller spec. */
  const char* embedding_name;          /* default "model.embed_tokens" */
  const char* layers_name;             /* default "model.layers" */
  const char* position_embedding_name; /* learned positions ("transformer.wpe"); NULL: rotary */
  int64_t max_position_embeddings;     /* the longest sequence, the learned table's rows; with
                                          rotary 0 (the default) sets no limit */
  int32_t projections;                 /* MESHRUN_KIT_LINEAR (default) or MESHRUN_KIT_CONV1D */
  int32_t scale_output_init;           /* GPT-2's scaled output projections (above) */
  double initializer_range;            /* the matrices' initial std; default 0.02 */
  /* The config.json keys of the sizes, as a JSON object from the kit's
   * names (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
   * num_attention_heads, num_key_value_heads, max_position_embeddings;
   * from 1.2 num_local_experts, num_experts_per_tok) to the model's
   * ({"hidden_size": "n_embd"}); a size mapped to null is not written.
   * NULL, or a size left out: the kit's name. */
  const char* size_keys;
  /* Kit 1.2: the mixture of experts of MESHRUN_KIT_MOE_MLP ops (above),
   * which need num_local_experts >= 1 and 1 <= num_experts_per_tok <=
   * num_local_experts; a model without one leaves them 0. The exported
   * config.json holds them under these names. A plugin checks
   * MESHRUN_HAS_FIELD first, as for 1.1's fields. */
  int64_t num_local_experts;
  int64_t num_experts_per_tok;
  double router_aux_loss_coef; /* >= 0 */
} meshrun_kit_model_spec;

/* The [model] config a compose call reads: opaque, owned by the kit. */
typedef struct meshrun_kit_config meshrun_kit_config;

/* A kit-composed model plugin: static in the plugin, valid while loaded. */
typedef struct meshrun_kit_plugin {
  size_t struct_size;
  const char* model_type;  /* also the plugin's name: [a-z0-9_]+ */
  const char* version;     /* the plugin's own version */
  const char* description; /* one line for `meshrun plugins` */
  /* The [model] keys compose reads, NULL-terminated: the host refuses any
   * other before a model is made. */
  const char* const* config_keys;
  /* Fills `spec` from `config`. An error (from the readers below, or the
   * plugin's own, message "model.<key>: ...") is handed to the host. */
  meshrun_error* (*compose)(const meshrun_kit_config* config, meshrun_kit_model_spec* spec);
} meshrun_kit_plugin;

/* The kit's version: MESHRUN_KIT_VERSION_MAJOR << 16 | MINOR of the
 * library loaded. */
MESHRUN_KIT_EXPORT uint32_t meshrun_kit_version(void);

/* The value of [model] key `key`, or `fallback` when it is not set, in
 * *out. INVALID_ARGUMENT "model.<key>: expected ..." for a value of
 * another type or outside [min, max]; NULL arguments are INVALID_ARGUMENT. */
MESHRUN_KIT_EXPORT meshrun_error* meshrun_kit_config_integer(const meshrun_kit_config* config,
                                                             const char* key, int64_t fallback,
                                                             int64_t min, int64_t max,
                                                             int64_t* out);
/* A number > 0. */
MESHRUN_KIT_EXPORT meshrun_error* meshrun_kit_config_positive(const meshrun_kit_config* config,
                                                              const char* key, double fallback,
                                                              double* out);
/* true or false, as 1 or 0. */
MESHRUN_KIT_EXPORT meshrun_error* meshrun_kit_config_boolean(const meshrun_kit_config* config,
                                                             const char* key, int32_t fallback,
                                                             int32_t* out);

/* The [model] keys the user set, as the JSON object model_create was given:
 * for a plugin that reads them with a JSON parser of its own. Owned by
 * `config`, valid during the compose call; NULL when `config` is NULL. */
MESHRUN_KIT_EXPORT const char* meshrun_kit_config_json(const meshrun_kit_config* config);

/* A copy of the NUL-terminated `text`, owned by `config` and valid until
 * the model is made (meshrun_kit_model_create returns): for strings a
 * compose call builds (a config_json of derived values) and hands in the
 * spec. NULL when an argument is NULL or memory runs out. (Kit 1.1.) */
MESHRUN_KIT_EXPORT const char* meshrun_kit_config_keep(const meshrun_kit_config* config,
                                                       const char* text);

/* Makes a model of `plugin` (the model table's model_create, which
 * MESHRUN_KIT_DEFINE_PLUGIN routes here): compose, then the composition
 * checked. Errors: compose's; INVALID_ARGUMENT for a composition or sizes
 * that do not line up. */
MESHRUN_KIT_EXPORT meshrun_error* meshrun_kit_model_create(const meshrun_kit_plugin* plugin,
                                                           meshrun_plugin_instance* instance,
                                                           const char* config_json,
                                                           meshrun_model** out);

/* The plugin table of `plugin`, made once per plugin and kept while the kit
 * is loaded; `model_create` is the plugin's function that calls
 * meshrun_kit_model_create with `plugin`. NULL when an argument is NULL. */
MESHRUN_KIT_EXPORT const meshrun_plugin_api* meshrun_kit_plugin_api(
    const meshrun_kit_plugin* plugin,
    meshrun_error* (*model_create)(meshrun_plugin_instance* instance, const char* config_json,
                                   meshrun_model** out));

/* Defines the plugin's one exported symbol, meshrun_plugin_get_api, for the
 * static meshrun_kit_plugin `plugin`. */
#define MESHRUN_KIT_DEFINE_PLUGIN(plugin)                                                \
  static meshrun_error* meshrun_kit_model_create_##plugin(                               \
      meshrun_plugin_instance* instance, const char* config_json, meshrun_model** out) { \
    return meshrun_kit_model_create(&(plugin), instance, config_json, out);              \
  }                                                                                      \
  const meshrun_plugin_api* meshrun_plugin_get_api(void) {                               \
    return meshrun_kit_plugin_api(&(plugin), meshrun_kit_model_create_##plugin);         \
  }

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_KIT_H_ */
