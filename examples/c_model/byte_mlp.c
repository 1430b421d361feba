/*
 * byte_mlp — a meshrun model plugin in plain C11 (model_type "byte_mlp").
 *
 * A byte-level language model small enough to read in one sitting, built
 * against the installed headers only (meshrun/model.h), to show what a third
 * party writes so that `meshrun train` trains its model with any strategy:
 *
 *   x_0     = E[token_t] + P[token_t-1]                (no P term at t = 0)
 *   x_l+1   = x_l + W2_l gelu(W1_l x_l + b1_l) + b2_l  (blocks l = 0 .. L-1)
 *   logits  = Wo x_L + bo
 *   loss    = mean over the tokens of -log softmax(logits)[target_t]
 *
 * E, P and Wo are [256, hidden_size], W1 is [intermediate_size,
 * hidden_size], W2 [hidden_size, intermediate_size]. Each block is a unit
 * ("blocks.N") that a sharding strategy gathers before it runs and frees
 * after; the embeddings and the head form the root unit, which encloses the
 * blocks. The modules (embed, blocks.N, head) let the default plan cut the
 * model into pipeline stages.
 *
 * The plugin owns no parameter storage: at every unit boundary it calls the
 * host's hooks and asks for views of the unit's parameters and gradients,
 * which is all DDP, FSDP2 and the pipeline schedules need. The sizes are
 * tiny, so the math is plain loops, each forward beside its backward.
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "meshrun/plugin.h"

/* The trainer's data are bytes. */
#define VOCAB 256
/* Upper bounds of the [model] keys: far beyond what plain loops can train,
 * and small enough that no size computed from them overflows. */
#define MAX_HIDDEN_SIZE 16384
#define MAX_INTERMEDIATE_SIZE 65536
#define MAX_LAYERS 1000
/* A JSON config nested deeper than this is refused rather than recursed. */
#define MAX_JSON_DEPTH 32

/* Lets the compiler check the format strings of the message helpers. */
#if defined(__GNUC__)
#define PRINTF_LIKE(format_index, first_argument) \
  __attribute__((format(printf, format_index, first_argument)))
#else
#define PRINTF_LIKE(format_index, first_argument)
#endif

/* Returns a non-NULL error of `call` from the enclosing function: a hook's
 * error goes back to the host unchanged, as model.h asks. */
#define TRY(call)                              \
  do {                                         \
    meshrun_error* try_error_ = (call);        \
    if (try_error_ != NULL) return try_error_; \
  } while (0)

/* ---- Plugin instance, errors, memory -------------------------------------- */

/* The instance state. The host services table is borrowed until destroy. */
struct meshrun_plugin_instance {
  const meshrun_host_services* host;
};

/* Without a usable host table (or without a handle that leads to one) no
 * make_error can be reached, so these errors are static: their destroy frees
 * nothing. */
static void static_error_destroy(meshrun_error* error) { (void)error; }

static meshrun_error null_host_error = {sizeof(meshrun_error), MESHRUN_INVALID_ARGUMENT,
                                        "byte_mlp: host services table is NULL",
                                        static_error_destroy};

static meshrun_error small_host_error = {
    sizeof(meshrun_error), MESHRUN_INVALID_ARGUMENT,
    "byte_mlp: host services table is smaller than ABI 1.0 requires", static_error_destroy};

static meshrun_error null_handle_error = {
    sizeof(meshrun_error), MESHRUN_INVALID_ARGUMENT,
    "byte_mlp: the plugin instance, model or stage passed is NULL", static_error_destroy};

/* An error made by the host's make_error, so that the host frees it with its
 * own destroy; the message is formatted like printf's. */
static meshrun_error* fail(const meshrun_host_services* host, int32_t code, const char* format, ...)
    PRINTF_LIKE(3, 4);
static meshrun_error* fail(const meshrun_host_services* host, int32_t code, const char* format,
                           ...) {
  char message[512];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  return host->make_error(host->context, code, message);
}

/* Zeroed memory from the host's allocator, aligned to a cache line for the
 * loops over rows; NULL when it is exhausted. */
static void* allocate(const meshrun_host_services* host, size_t bytes) {
  void* memory = host->allocate(host->context, bytes, 64);
  if (memory != NULL) memset(memory, 0, bytes);
  return memory;
}

/* Returns memory from allocate() to the host; NULL is accepted. */
static void release(const meshrun_host_services* host, void* memory) {
  host->deallocate(host->context, memory);
}

/* The plugin's create: checks the host table once, so that every later call
 * can rely on its services. */
static meshrun_error* byte_mlp_create(const meshrun_host_services* host,
                                      meshrun_plugin_instance** out) {
  if (host == NULL) return &null_host_error;
  /* Any table at least as large as the 1.0 one: a newer host's is larger,
   * and its extra fields are simply not read here. */
  if (host->struct_size < MESHRUN_HOST_SERVICES_SIZE_1_0) return &small_host_error;
  if (host->abi_major != MESHRUN_ABI_VERSION_MAJOR) {
    return fail(host, MESHRUN_VERSION_MISMATCH,
                "byte_mlp: host ABI major %d differs from the one this plugin was built for (%d)",
                (int)host->abi_major, MESHRUN_ABI_VERSION_MAJOR);
  }
  if (out == NULL) return fail(host, MESHRUN_INVALID_ARGUMENT, "byte_mlp: create: out is NULL");
  meshrun_plugin_instance* instance = allocate(host, sizeof *instance);
  if (instance == NULL) return fail(host, MESHRUN_INTERNAL, "byte_mlp: out of memory");
  instance->host = host;
  *out = instance;
  return NULL;
}

/* The plugin's destroy; NULL is accepted, as the ABI asks of every destroy. */
static void byte_mlp_destroy(meshrun_plugin_instance* instance) {
  if (instance != NULL) release(instance->host, instance);
}

/* ---- Configuration: the [model] keys -------------------------------------- */

/* The architecture, every key with its default applied. */
typedef struct byte_mlp_config {
  int64_t hidden_size;       /* H, the width of the residual stream */
  int64_t intermediate_size; /* I, the width inside a block (default 4 H) */
  int64_t num_layers;        /* L, the number of blocks */
  double initializer_range;  /* the standard deviation of the initial weights */
} byte_mlp_config;

/* The [model] keys it reads, besides model_type, torch_dtype and checkpoint:
 * the host refuses any other key before model_create. */
static const char* const config_keys[] = {"hidden_size", "intermediate_size", "num_layers",
                                          "initializer_range", NULL};

/* A piece of the config text, [begin, end): a key's name or a value. */
typedef struct span {
  const char* begin;
  const char* end;
} span;

/* The [model] config arrives as JSON (a flat object of the keys the user
 * set); these few functions read that much JSON and no more, so the plugin
 * needs nothing beyond libc. Each returns the end of what it read, or NULL
 * when the text is not JSON. */

/* An ASCII digit; isdigit() would depend on the locale. */
static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Past JSON's whitespace, which is only these four. */
static const char* skip_space(const char* p) {
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') ++p;
  return p;
}

/* A string, p at its opening quote; escapes are checked, not decoded (no
 * key of this model needs one). */
static const char* string_end(const char* p) {
  for (++p; *p != '"'; ++p) {
    if ((unsigned char)*p < 0x20) return NULL; /* the end of the text, or a control byte */
    if (*p != '\\') continue;
    ++p;
    if (*p == 'u') {
      for (int i = 0; i < 4; ++i) {
        if (strchr("0123456789abcdefABCDEF", *++p) == NULL || *p == '\0') return NULL;
      }
    } else if (*p == '\0' || strchr("\"\\/bfnrt", *p) == NULL) {
      return NULL;
    }
  }
  return p + 1;
}

/* A number; *integer says whether it has neither fraction nor exponent. */
static const char* number_end(const char* p, int* integer) {
  *integer = 1;
  if (*p == '-') ++p;
  if (*p == '0') {
    ++p;
  } else if (is_digit(*p)) {
    while (is_digit(*p)) ++p;
  } else {
    return NULL;
  }
  if (*p == '.') {
    *integer = 0;
    if (!is_digit(*++p)) return NULL;
    while (is_digit(*p)) ++p;
  }
  if (*p == 'e' || *p == 'E') {
    *integer = 0;
    ++p;
    if (*p == '+' || *p == '-') ++p;
    if (!is_digit(*p)) return NULL;
    while (is_digit(*p)) ++p;
  }
  return p;
}

/* Any value, nested at most `depth` levels deep; only its end is wanted:
 * a value of the wrong type is refused later, with its text quoted. */
static const char* value_end(const char* p, int depth) {
  int integer;
  if (*p == '"') return string_end(p);
  if (*p == '{' || *p == '[') {
    const char close = *p == '{' ? '}' : ']';
    if (depth == 0) return NULL;
    p = skip_space(p + 1);
    if (*p == close) return p + 1;
    for (;;) {
      if (close == '}') {
        if (*p != '"' || (p = string_end(p)) == NULL) return NULL;
        p = skip_space(p);
        if (*p != ':') return NULL;
        p = skip_space(p + 1);
      }
      if ((p = value_end(p, depth - 1)) == NULL) return NULL;
      p = skip_space(p);
      if (*p == close) return p + 1;
      if (*p != ',') return NULL;
      p = skip_space(p + 1);
    }
  }
  if (strncmp(p, "true", 4) == 0 || strncmp(p, "null", 4) == 0) return p + 4;
  if (strncmp(p, "false", 5) == 0) return p + 5;
  return number_end(p, &integer);
}

/* Whether the key text `key` (between its quotes) is `name`. */
static int key_is(span key, const char* name) {
  return (size_t)(key.end - key.begin) == strlen(name) &&
         memcmp(key.begin, name, strlen(name)) == 0;
}

/* At most this much of a bad value is quoted in a message. */
static int quoted_length(span value) {
  return value.end - value.begin > 60 ? 60 : (int)(value.end - value.begin);
}

/* Integer key `name`: a JSON integer in [min, max]. */
static meshrun_error* read_integer(const meshrun_host_services* host, const char* name, span value,
                                   int64_t min, int64_t max, int64_t* out) {
  int integer = 0;
  if (number_end(value.begin, &integer) == value.end && integer) {
    /* Anything longer than 18 digits is out of range anyway, and shorter
     * ones cannot overflow; strtoll needs a NUL-terminated copy. */
    char digits[20] = {0};
    if (value.end - value.begin < (ptrdiff_t)sizeof digits) {
      memcpy(digits, value.begin, (size_t)(value.end - value.begin));
      const long long parsed = strtoll(digits, NULL, 10);
      if (parsed >= min && parsed <= max) {
        *out = parsed;
        return NULL;
      }
    }
  }
  return fail(host, MESHRUN_INVALID_ARGUMENT,
              "model.%s: expected an integer in [%" PRId64 ", %" PRId64 "], got %.*s", name, min,
              max, quoted_length(value), value.begin);
}

/* Number key `name`: a JSON number in (0, max]. */
static meshrun_error* read_positive(const meshrun_host_services* host, const char* name, span value,
                                    double max, double* out) {
  int integer = 0;
  if (number_end(value.begin, &integer) == value.end) {
    char text[64] = {0};
    if (value.end - value.begin < (ptrdiff_t)sizeof text) {
      memcpy(text, value.begin, (size_t)(value.end - value.begin));
      const double parsed = strtod(text, NULL);
      if (parsed > 0 && parsed <= max) {
        *out = parsed;
        return NULL;
      }
    }
  }
  return fail(host, MESHRUN_INVALID_ARGUMENT, "model.%s: expected a number in (0, %g], got %.*s",
              name, max, quoted_length(value), value.begin);
}

/* One key of the config into *config. */
static meshrun_error* read_key(const meshrun_host_services* host, span key, span value,
                               byte_mlp_config* config) {
  if (key_is(key, "hidden_size")) {
    return read_integer(host, "hidden_size", value, 1, MAX_HIDDEN_SIZE, &config->hidden_size);
  }
  if (key_is(key, "intermediate_size")) {
    return read_integer(host, "intermediate_size", value, 1, MAX_INTERMEDIATE_SIZE,
                        &config->intermediate_size);
  }
  if (key_is(key, "num_layers")) {
    return read_integer(host, "num_layers", value, 1, MAX_LAYERS, &config->num_layers);
  }
  if (key_is(key, "initializer_range")) {
    return read_positive(host, "initializer_range", value, 1.0, &config->initializer_range);
  }
  /* The host refuses unknown keys first; another host may not. */
  return fail(host, MESHRUN_INVALID_ARGUMENT,
              "model.%.*s: unknown key for model_type 'byte_mlp' (its keys: hidden_size, "
              "intermediate_size, num_layers, initializer_range)",
              (int)(key.end - key.begin), key.begin);
}

/* A config that is not JSON, with where it stops being JSON. */
static meshrun_error* malformed(const meshrun_host_services* host, const char* json,
                                const char* at) {
  return fail(host, MESHRUN_INVALID_ARGUMENT,
              "model: the config is not a JSON object (malformed at byte %td)", at - json);
}

/* The config JSON of model_create into *out, defaults applied. */
static meshrun_error* parse_config(const meshrun_host_services* host, const char* json,
                                   byte_mlp_config* out) {
  byte_mlp_config config = {64, 0, 2, 0.02};
  const char* p = skip_space(json);
  if (*p != '{') {
    return fail(host, MESHRUN_INVALID_ARGUMENT, "model: the config is not a JSON object");
  }
  p = skip_space(p + 1);
  for (int more = *p != '}'; more;) {
    span key, value;
    if (*p != '"' || (key.end = string_end(p)) == NULL) return malformed(host, json, p);
    key.begin = p + 1;
    --key.end; /* the closing quote */
    p = skip_space(key.end + 1);
    if (*p != ':') return malformed(host, json, p);
    value.begin = skip_space(p + 1);
    value.end = value_end(value.begin, MAX_JSON_DEPTH);
    if (value.end == NULL) return malformed(host, json, value.begin);
    p = skip_space(value.end);
    if (*p != ',' && *p != '}') return malformed(host, json, p);
    TRY(read_key(host, key, value, &config));
    more = *p == ',';
    if (more) p = skip_space(p + 1);
  }
  if (*skip_space(p + 1) != '\0') return malformed(host, json, p + 1);
  if (config.intermediate_size == 0) config.intermediate_size = 4 * config.hidden_size;
  *out = config;
  return NULL;
}

/* ---- The description: parameters, units, modules ------------------------- */

/* What each parameter is, in description order: the two embeddings, each
 * block's four tensors, then the head's two. The embeddings are parameters
 * 0 and 1, so their roles are also their indices. */
enum {
  ROLE_EMBED,
  ROLE_EMBED_PREV,
  ROLE_FC1_WEIGHT,
  ROLE_FC1_BIAS,
  ROLE_FC2_WEIGHT,
  ROLE_FC2_BIAS,
  ROLE_HEAD_WEIGHT,
  ROLE_HEAD_BIAS
};
#define PARAMETERS_PER_BLOCK 4

/* A parameter's name, shape and unit (a block's index, or L for the root). */
typedef struct parameter_info {
  int role;
  int32_t unit;
  int32_t ndim;
  int64_t shape[2];
  char name[48];
} parameter_info;

/* One configured model. */
struct meshrun_model {
  const meshrun_host_services* host;
  byte_mlp_config config;
};

/* The two embeddings, four tensors per block, the head's two. */
static int64_t parameter_count(const byte_mlp_config* c) {
  return 4 + PARAMETERS_PER_BLOCK * c->num_layers;
}

/* The index of `role` (a block's) in block `block`. */
static int64_t block_parameter(int64_t block, int role) {
  return 2 + PARAMETERS_PER_BLOCK * block + (role - ROLE_FC1_WEIGHT);
}

/* The index of `role` (the head's). */
static int64_t head_parameter(const byte_mlp_config* c, int role) {
  return 2 + PARAMETERS_PER_BLOCK * c->num_layers + (role - ROLE_HEAD_WEIGHT);
}

/* Parameter `p`, which must be below parameter_count(). */
static parameter_info parameter_of(const byte_mlp_config* c, int64_t p) {
  static const char* const suffixes[] = {"embed.weight", "embed_prev.weight", "fc1.weight",
                                         "fc1.bias",     "fc2.weight",        "fc2.bias",
                                         "head.weight",  "head.bias"};
  const int64_t H = c->hidden_size, I = c->intermediate_size, L = c->num_layers;
  parameter_info info;
  int64_t block = -1;
  if (p < 2) {
    info.role = (int)p;
  } else if (p < 2 + PARAMETERS_PER_BLOCK * L) {
    block = (p - 2) / PARAMETERS_PER_BLOCK;
    info.role = ROLE_FC1_WEIGHT + (int)((p - 2) % PARAMETERS_PER_BLOCK);
  } else {
    info.role = ROLE_HEAD_WEIGHT + (int)(p - 2 - PARAMETERS_PER_BLOCK * L);
  }
  info.unit = (int32_t)(block >= 0 ? block : L);
  const int64_t shapes[][2] = {{VOCAB, H}, {VOCAB, H}, {I, H},     {I, 0},
                               {H, I},     {H, 0},     {VOCAB, H}, {VOCAB, 0}};
  info.shape[0] = shapes[info.role][0];
  info.shape[1] = shapes[info.role][1];
  info.ndim = info.shape[1] > 0 ? 2 : 1;
  if (block >= 0) {
    snprintf(info.name, sizeof info.name, "blocks.%" PRId64 ".%s", block, suffixes[info.role]);
  } else {
    snprintf(info.name, sizeof info.name, "%s", suffixes[info.role]);
  }
  return info;
}

/* A NUL-terminated string growing in host memory, for describe's JSON. Once
 * an allocation fails `data` is NULL and appends do nothing, so the caller
 * checks once, at the end. */
typedef struct text {
  const meshrun_host_services* host;
  char* data;
  size_t length, capacity;
} text;

static void append(text* t, const char* format, ...) PRINTF_LIKE(2, 3);
static void append(text* t, const char* format, ...) {
  while (t->data != NULL) {
    va_list args;
    va_start(args, format);
    const int written = vsnprintf(t->data + t->length, t->capacity - t->length, format, args);
    va_end(args);
    if (written >= 0 && (size_t)written < t->capacity - t->length) {
      t->length += (size_t)written;
      return;
    }
    /* Too long for what is left: grow, then format again. */
    char* larger = written < 0 ? NULL : allocate(t->host, 2 * t->capacity + (size_t)written);
    if (larger != NULL) {
      memcpy(larger, t->data, t->length + 1);
      t->capacity = 2 * t->capacity + (size_t)written;
    }
    release(t->host, t->data);
    t->data = larger;
  }
}

/* A double as JSON: the shortest %g that reads back as the same value. */
static void format_number(double value, char out[32]) {
  for (int digits = 1; digits <= 17; ++digits) {
    snprintf(out, 32, "%.*g", digits, value);
    if (strtod(out, NULL) == value) return;
  }
}

/* The description of model.h, allocated with the host's allocate. */
static meshrun_error* byte_mlp_describe(meshrun_model* model, char** out_json) {
  if (model == NULL) return &null_handle_error;
  const meshrun_host_services* host = model->host;
  if (out_json == NULL) {
    return fail(host, MESHRUN_INVALID_ARGUMENT, "byte_mlp: describe: out_json is NULL");
  }
  const byte_mlp_config* c = &model->config;
  char range[32];
  format_number(c->initializer_range, range);
  text t = {host, allocate(host, 4096), 0, 4096};
  append(&t,
         "{\"config\":{\"architectures\":[\"ByteMLPForCausalLM\"],\"model_type\":\"byte_mlp\","
         "\"vocab_size\":%d,\"hidden_size\":%" PRId64 ",\"intermediate_size\":%" PRId64
         ",\"num_layers\":%" PRId64
         ",\"initializer_range\":%s,\"hidden_act\":\"gelu_pytorch_tanh\","
         "\"tie_word_embeddings\":false},\"parameters\":[",
         VOCAB, c->hidden_size, c->intermediate_size, c->num_layers, range);
  for (int64_t p = 0; p < parameter_count(c); ++p) {
    const parameter_info info = parameter_of(c, p);
    append(&t, "%s{\"name\":\"%s\",\"shape\":[%" PRId64, p > 0 ? "," : "", info.name,
           info.shape[0]);
    if (info.ndim == 2) append(&t, ",%" PRId64, info.shape[1]);
    if (info.unit == c->num_layers) {
      append(&t, "],\"unit\":\"root\"}");
    } else {
      append(&t, "],\"unit\":\"blocks.%" PRId32 "\"}", info.unit);
    }
  }
  append(&t, "],\"units\":[");
  for (int64_t l = 0; l < c->num_layers; ++l) append(&t, "\"blocks.%" PRId64 "\",", l);
  append(&t,
         "\"root\"],\"modules\":[{\"name\":\"embed\",\"parameters\":"
         "[\"embed.weight\",\"embed_prev.weight\"]}");
  for (int64_t l = 0; l < c->num_layers; ++l) {
    append(&t, ",{\"name\":\"blocks.%" PRId64 "\",\"parameters\":[", l);
    for (int role = ROLE_FC1_WEIGHT; role <= ROLE_FC2_BIAS; ++role) {
      append(&t, "%s\"%s\"", role > ROLE_FC1_WEIGHT ? "," : "",
             parameter_of(c, block_parameter(l, role)).name);
    }
    append(&t, "]}");
  }
  append(&t,
         ",{\"name\":\"head\",\"parameters\":[\"head.weight\",\"head.bias\"]}],"
         "\"vocab_size\":%d,\"max_seq_len\":null,\"num_layers_key\":\"num_layers\"}",
         VOCAB);
  if (t.data == NULL) return fail(host, MESHRUN_INTERNAL, "byte_mlp: describe: out of memory");
  *out_json = t.data;
  return NULL;
}

/* model_create: the config's errors name their key ("model.<key>: ..."), so
 * the host can point at its place in the config file. */
static meshrun_error* byte_mlp_model_create(meshrun_plugin_instance* instance,
                                            const char* config_json, meshrun_model** out) {
  if (instance == NULL) return &null_handle_error;
  const meshrun_host_services* host = instance->host;
  if (config_json == NULL || out == NULL) {
    return fail(host, MESHRUN_INVALID_ARGUMENT,
                "byte_mlp: model_create: config_json or out is NULL");
  }
  byte_mlp_config config;
  TRY(parse_config(host, config_json, &config));
  meshrun_model* model = allocate(host, sizeof *model);
  if (model == NULL) return fail(host, MESHRUN_INTERNAL, "byte_mlp: out of memory");
  model->host = host;
  model->config = config;
  *out = model;
  return NULL;
}

/* model_destroy, after the model's stages (which copy its config). */
static void byte_mlp_model_destroy(meshrun_model* model) {
  if (model != NULL) release(model->host, model);
}

/* ---- Initial values --------------------------------------------------------- */

/* splitmix64's finalizer: a counter-based hash, so that any element's value
 * comes from (seed, parameter, element) alone, whoever initializes it. */
static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Uniform in [-1, 1) from the top 24 bits of the hash, exact in a float. */
static float uniform(uint64_t seed, int64_t parameter, int64_t element) {
  const uint64_t hash = mix(mix(mix(seed) ^ (uint64_t)parameter) ^ (uint64_t)element);
  return (float)(hash >> 40) / (float)(1u << 23) - 1.0f;
}

/* Weights uniform with standard deviation initializer_range (a uniform on
 * [-a, a) has a / sqrt(3)), biases 0. W2 is scaled by 1 / sqrt(2 L), as in
 * GPT-2: the L blocks add into one residual stream, whose variance would
 * otherwise grow with depth. */
static meshrun_error* byte_mlp_init_parameter(meshrun_model* model, uint64_t seed,
                                              int64_t parameter, DLTensor* value) {
  if (model == NULL) return &null_handle_error;
  const meshrun_host_services* host = model->host;
  const byte_mlp_config* c = &model->config;
  if (parameter < 0 || parameter >= parameter_count(c)) {
    return fail(host, MESHRUN_OUT_OF_RANGE,
                "byte_mlp: init_parameter: no parameter %" PRId64 " (the model has %" PRId64 ")",
                parameter, parameter_count(c));
  }
  const parameter_info info = parameter_of(c, parameter);
  if (value == NULL || value->data == NULL || value->dtype.code != kDLFloat ||
      value->dtype.bits != 32 || value->dtype.lanes != 1 || value->ndim != info.ndim ||
      value->shape[0] != info.shape[0] || (info.ndim == 2 && value->shape[1] != info.shape[1])) {
    return fail(host, MESHRUN_INVALID_ARGUMENT,
                "byte_mlp: init_parameter: '%s' needs a float32 tensor of its described shape",
                info.name);
  }
  float* values = (float*)((char*)value->data + value->byte_offset);
  const int64_t numel = info.shape[0] * (info.ndim == 2 ? info.shape[1] : 1);
  float scale = (float)(c->initializer_range * sqrt(3.0));
  if (info.role == ROLE_FC2_WEIGHT) scale /= (float)sqrt(2.0 * (double)c->num_layers);
  const int bias =
      info.role == ROLE_FC1_BIAS || info.role == ROLE_FC2_BIAS || info.role == ROLE_HEAD_BIAS;
  for (int64_t i = 0; i < numel; ++i) {
    values[i] = bias ? 0.0f : scale * uniform(seed, parameter, i);
  }
  return NULL;
}

/* ---- The math ------------------------------------------------------------- */

/* GELU, tanh approximation (Hugging Face's gelu_pytorch_tanh), and its
 * derivative:
 *   gelu(h)  = h/2 (1 + tanh(u)),  u = sqrt(2/pi) (h + 0.044715 h^3)
 *   gelu'(h) = (1 + tanh(u))/2 + h/2 (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 0.044715 h^2) */
#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_CUBIC 0.044715f

static float gelu(float h) {
  return 0.5f * h * (1.0f + tanhf(GELU_SCALE * (h + GELU_CUBIC * h * h * h)));
}

static float gelu_grad(float h) {
  const float t = tanhf(GELU_SCALE * (h + GELU_CUBIC * h * h * h));
  return 0.5f * (1.0f + t) +
         0.5f * h * (1.0f - t * t) * GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * h * h);
}

/* Views of a unit's parameters (and, in a backward, their gradients), valid
 * from the unit's pre_ hook to its post_ hook. */
typedef struct root_views {
  float *embed, *embed_prev, *head_weight, *head_bias;
  float *d_embed, *d_embed_prev, *d_head_weight, *d_head_bias;
} root_views;

typedef struct block_views {
  float *w1, *b1, *w2, *b2;
  float *d_w1, *d_b1, *d_w2, *d_b2;
} block_views;

/* Embedding, rows n = (sequence, t) of [batch, seq_len]:
 *   forward:  x_n = E[token_n] + P[token_n-1]  (P's term only for t > 0)
 *   backward: dE[token_n] += dx_n,  dP[token_n-1] += dx_n */
static void embed_forward(const root_views* w, const int32_t* tokens, int64_t batch,
                          int64_t seq_len, int64_t H, float* x) {
  for (int64_t n = 0; n < batch * seq_len; ++n) {
    const float* e = w->embed + tokens[n] * H;
    const float* prev = n % seq_len > 0 ? w->embed_prev + tokens[n - 1] * H : NULL;
    for (int64_t k = 0; k < H; ++k) x[n * H + k] = e[k] + (prev != NULL ? prev[k] : 0.0f);
  }
}

static void embed_backward(const root_views* w, const int32_t* tokens, int64_t batch,
                           int64_t seq_len, int64_t H, const float* dx) {
  for (int64_t n = 0; n < batch * seq_len; ++n) {
    float* de = w->d_embed + tokens[n] * H;
    float* dprev = n % seq_len > 0 ? w->d_embed_prev + tokens[n - 1] * H : NULL;
    for (int64_t k = 0; k < H; ++k) {
      de[k] += dx[n * H + k];
      if (dprev != NULL) dprev[k] += dx[n * H + k];
    }
  }
}

/* A block over N rows, with a = gelu(h) recomputed from the h kept:
 *   forward:  h = W1 x + b1,  y = x + W2 a + b2
 *   backward: dW2 += dy a^T,  db2 += dy,  dh = (W2^T dy) * gelu'(h),
 *             dW1 += dh x^T,  db1 += dh,  dx = dy + W1^T dh
 * The backward turns dy into dx in place. `row` holds 2 I floats. */
static void block_forward(const block_views* w, int64_t N, int64_t H, int64_t I, const float* x,
                          float* h, float* y, float* row) {
  float* a = row;
  for (int64_t n = 0; n < N; ++n) {
    const float* xn = x + n * H;
    float* hn = h + n * I;
    for (int64_t i = 0; i < I; ++i) {
      float sum = w->b1[i];
      for (int64_t k = 0; k < H; ++k) sum += w->w1[i * H + k] * xn[k];
      hn[i] = sum;
      a[i] = gelu(sum);
    }
    for (int64_t j = 0; j < H; ++j) {
      float sum = w->b2[j];
      for (int64_t i = 0; i < I; ++i) sum += w->w2[j * I + i] * a[i];
      y[n * H + j] = xn[j] + sum;
    }
  }
}

static void block_backward(const block_views* w, int64_t N, int64_t H, int64_t I, const float* x,
                           const float* h, float* dx, float* row) {
  float *a = row, *dh = row + I;
  for (int64_t n = 0; n < N; ++n) {
    const float* xn = x + n * H;
    const float* hn = h + n * I;
    float* dy = dx + n * H;
    for (int64_t i = 0; i < I; ++i) {
      a[i] = gelu(hn[i]);
      dh[i] = 0.0f;
    }
    for (int64_t j = 0; j < H; ++j) {
      w->d_b2[j] += dy[j];
      for (int64_t i = 0; i < I; ++i) {
        w->d_w2[j * I + i] += dy[j] * a[i];
        dh[i] += w->w2[j * I + i] * dy[j];
      }
    }
    for (int64_t i = 0; i < I; ++i) {
      dh[i] *= gelu_grad(hn[i]);
      w->d_b1[i] += dh[i];
      for (int64_t k = 0; k < H; ++k) {
        w->d_w1[i * H + k] += dh[i] * xn[k];
        dy[k] += w->w1[i * H + k] * dh[i]; /* dy is done with: it becomes dx */
      }
    }
  }
}

/* The head and the loss over N rows, p = softmax(logits) kept per row:
 *   forward:  logits = Wo x + bo,  loss = mean_n (log sum_v exp logits_v - logits_target)
 *   backward: g = scale / N (p - onehot(target)),
 *             dWo += g x^T,  dbo += g,  dx = Wo^T g
 * where scale is d objective / d loss. `row` holds VOCAB floats. */
static double head_forward(const root_views* w, int64_t N, int64_t H, const float* x,
                           const int32_t* targets, float* p) {
  double total = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    float* pn = p + n * VOCAB;
    float max = -INFINITY;
    for (int64_t v = 0; v < VOCAB; ++v) {
      float z = w->head_bias[v];
      for (int64_t k = 0; k < H; ++k) z += w->head_weight[v * H + k] * x[n * H + k];
      pn[v] = z;
      if (z > max) max = z;
    }
    const float target = pn[targets[n]] - max;
    double sum = 0.0;
    for (int64_t v = 0; v < VOCAB; ++v) {
      pn[v] = expf(pn[v] - max);
      sum += pn[v];
    }
    for (int64_t v = 0; v < VOCAB; ++v) pn[v] = (float)(pn[v] / sum);
    total += log(sum) - target;
  }
  return total / (double)N;
}

static void head_backward(const root_views* w, int64_t N, int64_t H, const float* x,
                          const int32_t* targets, const float* p, float scale, float* dx,
                          float* row) {
  const float s = scale / (float)N;
  for (int64_t n = 0; n < N; ++n) {
    float* dxn = dx + n * H;
    for (int64_t v = 0; v < VOCAB; ++v) row[v] = s * (p[n * VOCAB + v] - (v == targets[n]));
    for (int64_t k = 0; k < H; ++k) dxn[k] = 0.0f;
    for (int64_t v = 0; v < VOCAB; ++v) {
      w->d_head_bias[v] += row[v];
      for (int64_t k = 0; k < H; ++k) {
        w->d_head_weight[v * H + k] += row[v] * x[n * H + k];
        dxn[k] += w->head_weight[v * H + k] * row[v];
      }
    }
  }
}

/* ---- Stages ----------------------------------------------------------------- */

/* What one microbatch's forward keeps for its backward, in one host
 * allocation: the struct, then its arrays. */
typedef struct microbatch {
  struct microbatch* next;
  int32_t id;
  int64_t bytes;         /* of the whole allocation, for activation_bytes */
  int32_t* tokens;       /* [N] with the embedding, else NULL */
  int32_t* targets;      /* [N] with the head, else NULL */
  float* hidden;         /* [blocks + 1][N][H]: the stage's input, then each block's output */
  float* pre_activation; /* [blocks][N][I]: each block's h */
  float* probabilities;  /* [N][VOCAB] with the head, else NULL */
} microbatch;

/* A contiguous run of modules: maybe the embedding, blocks [first_block,
 * end_block), maybe the head. */
struct meshrun_model_stage {
  const meshrun_host_services* host;
  const meshrun_model_hooks* hooks; /* borrowed until stage_destroy */
  byte_mlp_config config;
  int embed, head;
  int64_t first_block, end_block;
  int64_t batch, seq_len; /* from set_shape; 0 before */
  float* grad_hidden;     /* [N][H]: the backward's gradient of the residual stream */
  float* row;             /* one row's scratch in the loops (see the math) */
  microbatch* in_flight;  /* a list: pipeline schedules keep several */
};

/* Unit indices into the description's "units": block l is l, the root L. */
static int32_t root_unit(const meshrun_model_stage* s) { return (int32_t)s->config.num_layers; }
/* The root's hooks come only with a root parameter: the embeddings or the head. */
static int holds_root(const meshrun_model_stage* s) { return s->embed || s->head; }
/* Token positions of a microbatch: the rows of every loop. */
static int64_t rows(const meshrun_model_stage* s) { return s->batch * s->seq_len; }

/* The position of module `name` in model order (embed, blocks.0 ..
 * blocks.L-1, head), or -1 for a name the model does not have. */
static int64_t module_position(const byte_mlp_config* c, const char* name) {
  if (strcmp(name, "embed") == 0) return 0;
  if (strcmp(name, "head") == 0) return c->num_layers + 1;
  if (strncmp(name, "blocks.", 7) != 0) return -1;
  const char* digits = name + 7;
  if (!is_digit(digits[0]) || (digits[0] == '0' && digits[1] != '\0')) return -1;
  int64_t block = 0;
  for (; *digits != '\0'; ++digits) {
    if (!is_digit(*digits)) return -1;
    block = 10 * block + (*digits - '0');
    if (block >= c->num_layers) return -1;
  }
  return 1 + block;
}

/* The model computes no tensor, context or expert parallelism: a mesh
 * that asks for it would get wrong results, so it is refused. */
static meshrun_error* check_axis(const meshrun_host_services* host,
                                 const meshrun_model_stage_setup* setup,
                                 const meshrun_communicator* axis, const char* axis_name,
                                 const char* parallelism) {
  int64_t size = 1;
  if (axis == NULL || setup->comm == NULL ||
      !MESHRUN_HAS_FIELD(meshrun_comm_api, setup->comm, size) || setup->comm->size == NULL) {
    return NULL;
  }
  TRY(setup->comm->size(axis, &size));
  if (size == 1) return NULL;
  return fail(host, MESHRUN_INVALID_ARGUMENT,
              "byte_mlp: the %s axis has %" PRId64 " ranks; this model computes no %s parallelism",
              axis_name, size, parallelism);
}

/* stage_create: any contiguous run of modules, so that a plan may cut the
 * model into pipeline stages between any two of them. */
static meshrun_error* byte_mlp_stage_create(meshrun_model* model,
                                            const meshrun_model_stage_setup* setup,
                                            meshrun_model_stage** out) {
  if (model == NULL) return &null_handle_error;
  const meshrun_host_services* host = model->host;
  const byte_mlp_config* c = &model->config;
  if (setup == NULL || out == NULL || setup->hooks == NULL) {
    return fail(host, MESHRUN_INVALID_ARGUMENT,
                "byte_mlp: stage_create: setup, hooks or out is NULL");
  }
  if (setup->struct_size < MESHRUN_MODEL_STAGE_SETUP_SIZE_1_5 ||
      setup->hooks->struct_size < MESHRUN_MODEL_HOOKS_SIZE_1_5) {
    return fail(host, MESHRUN_INVALID_ARGUMENT,
                "byte_mlp: stage_create: the setup or hooks table is smaller than ABI 1.5's");
  }
  /* Its kernels are plain C loops over host memory. */
  if (setup->struct_size >= MESHRUN_MODEL_STAGE_SETUP_SIZE_1_14 &&
      setup->device.device_type != kDLCPU) {
    return fail(host, MESHRUN_UNIMPLEMENTED,
                "byte_mlp: the stage setup's device (DLPack device type %d, id %d) is not the "
                "CPU, and this model computes on the CPU only",
                (int)setup->device.device_type, (int)setup->device.device_id);
  }
  if (setup->num_modules <= 0 || setup->modules == NULL) {
    return fail(host, MESHRUN_INVALID_ARGUMENT, "byte_mlp: a stage needs at least one module");
  }
  int64_t first = -1, last = -1;
  for (int64_t m = 0; m < setup->num_modules; ++m) {
    const char* name = setup->modules[m] != NULL ? setup->modules[m] : "";
    const int64_t position = module_position(c, name);
    if (position < 0) {
      return fail(host, MESHRUN_INVALID_ARGUMENT,
                  "byte_mlp: no module '%s' (the modules are embed, blocks.0 .. blocks.%" PRId64
                  ", head)",
                  name, c->num_layers - 1);
    }
    if (m > 0 && position != last + 1) {
      return fail(host, MESHRUN_INVALID_ARGUMENT,
                  "byte_mlp: module '%s' does not follow '%s': a stage computes a contiguous run "
                  "of modules in model order",
                  name, setup->modules[m - 1]);
    }
    if (m == 0) first = position;
    last = position;
  }
  TRY(check_axis(host, setup, setup->tp, "tp", "tensor"));
  TRY(check_axis(host, setup, setup->cp, "cp", "context"));
  TRY(check_axis(host, setup, setup->ep, "ep", "expert"));

  meshrun_model_stage* s = allocate(host, sizeof *s);
  /* The block loops need 2 I floats a row, the head's VOCAB. */
  const int64_t row = 2 * c->intermediate_size > VOCAB ? 2 * c->intermediate_size : VOCAB;
  float* scratch = allocate(host, (size_t)row * sizeof(float));
  if (s == NULL || scratch == NULL) {
    release(host, s);
    release(host, scratch);
    return fail(host, MESHRUN_INTERNAL, "byte_mlp: out of memory");
  }
  s->host = host;
  s->hooks = setup->hooks;
  s->config = *c;
  s->embed = first == 0;
  s->head = last == c->num_layers + 1;
  s->first_block = (first > 1 ? first : 1) - 1;
  s->end_block = last < c->num_layers ? last : c->num_layers;
  s->row = scratch;
  *out = s;
  return NULL;
}

/* Frees a microbatch's state: one allocation (see microbatch_create). */
static void microbatch_destroy(const meshrun_model_stage* s, microbatch* mb) {
  release(s->host, mb);
}

/* stage_destroy drops the microbatches still in flight. */
static void byte_mlp_stage_destroy(meshrun_model_stage* s) {
  if (s == NULL) return;
  while (s->in_flight != NULL) {
    microbatch* next = s->in_flight->next;
    microbatch_destroy(s, s->in_flight);
    s->in_flight = next;
  }
  release(s->host, s->grad_hidden);
  release(s->host, s->row);
  release(s->host, s);
}

/* set_shape: the backward's scratch follows the shape; refused while a
 * microbatch in flight holds state of another shape. */
static meshrun_error* byte_mlp_set_shape(meshrun_model_stage* s, int64_t batch, int64_t seq_len,
                                         int64_t* out_input_numel, int64_t* out_output_numel) {
  if (s == NULL) return &null_handle_error;
  if (out_input_numel == NULL || out_output_numel == NULL) {
    return fail(s->host, MESHRUN_INVALID_ARGUMENT, "byte_mlp: set_shape: an out pointer is NULL");
  }
  if (batch <= 0 || seq_len <= 0 || batch > INT32_MAX / seq_len) {
    return fail(s->host, MESHRUN_INVALID_ARGUMENT,
                "byte_mlp: set_shape: [%" PRId64 ", %" PRId64
                "] needs batch > 0, seq_len > 0 and fewer than 2^31 tokens",
                batch, seq_len);
  }
  if (batch != s->batch || seq_len != s->seq_len) {
    if (s->in_flight != NULL) {
      return fail(s->host, MESHRUN_FAILED_PRECONDITION,
                  "byte_mlp: set_shape to [%" PRId64 ", %" PRId64
                  "] while microbatch %d is in flight; finish its backward (or discard it) first",
                  batch, seq_len, (int)s->in_flight->id);
    }
    release(s->host, s->grad_hidden);
    s->batch = s->seq_len = 0;
    s->grad_hidden =
        allocate(s->host, (size_t)(batch * seq_len * s->config.hidden_size) * sizeof(float));
    if (s->grad_hidden == NULL) return fail(s->host, MESHRUN_INTERNAL, "byte_mlp: out of memory");
    s->batch = batch;
    s->seq_len = seq_len;
  }
  const int64_t hidden = batch * seq_len * s->config.hidden_size;
  *out_input_numel = s->embed ? 0 : hidden;
  *out_output_numel = s->head ? 0 : hidden;
  return NULL;
}

/* The microbatch `id` in flight, or NULL. */
static microbatch* find(const meshrun_model_stage* s, int32_t id) {
  microbatch* mb = s->in_flight;
  while (mb != NULL && mb->id != id) mb = mb->next;
  return mb;
}

/* Takes the microbatch `mb` out of the list in flight. */
static void unlink_microbatch(meshrun_model_stage* s, const microbatch* mb) {
  microbatch** at = &s->in_flight;
  while (*at != mb) at = &(*at)->next;
  *at = mb->next;
}

/* Token ids or targets: int32 [batch, seq_len], each a byte. */
static meshrun_error* check_ids(const meshrun_model_stage* s, const DLTensor* ids,
                                const char* what) {
  if (ids == NULL || ids->data == NULL || ids->dtype.code != kDLInt || ids->dtype.bits != 32 ||
      ids->dtype.lanes != 1 || ids->ndim != 2 || ids->shape[0] != s->batch ||
      ids->shape[1] != s->seq_len) {
    return fail(s->host, MESHRUN_INVALID_ARGUMENT,
                "byte_mlp: %s must be int32 [%" PRId64 ", %" PRId64 "] as set_shape said", what,
                s->batch, s->seq_len);
  }
  const int32_t* values = (const int32_t*)((const char*)ids->data + ids->byte_offset);
  for (int64_t n = 0; n < rows(s); ++n) {
    if (values[n] < 0 || values[n] >= VOCAB) {
      return fail(s->host, MESHRUN_OUT_OF_RANGE,
                  "byte_mlp: %s[%" PRId64 "] = %" PRId32 " is outside the vocabulary [0, %d)", what,
                  n, values[n], VOCAB);
    }
  }
  return NULL;
}

/* Hidden states at the stage's boundary: float32 of rows x H elements. */
static meshrun_error* check_hidden(const meshrun_model_stage* s, const DLTensor* hidden,
                                   const char* what) {
  int64_t numel = 1;
  if (hidden != NULL) {
    for (int32_t d = 0; d < hidden->ndim; ++d) numel *= hidden->shape[d];
  }
  if (hidden == NULL || hidden->data == NULL || hidden->dtype.code != kDLFloat ||
      hidden->dtype.bits != 32 || hidden->dtype.lanes != 1 ||
      numel != rows(s) * s->config.hidden_size) {
    return fail(s->host, MESHRUN_INVALID_ARGUMENT,
                "byte_mlp: %s must be float32 of %" PRId64 " elements (set_shape's numel)", what,
                rows(s) * s->config.hidden_size);
  }
  return NULL;
}

/* A float32 tensor's elements; DLPack counts byte_offset from data. */
static float* float_data(const DLTensor* tensor) {
  return (float*)((char*)tensor->data + tensor->byte_offset);
}

/* Parameter `p`'s value and, when `gradient` is not NULL, its gradient, as
 * the host lends them inside the parameter's unit. */
static meshrun_error* view(const meshrun_model_stage* s, int64_t p, float** value,
                           float** gradient) {
  DLTensor v, g;
  memset(&v, 0, sizeof v);
  memset(&g, 0, sizeof g);
  TRY(s->hooks->parameter(s->hooks->context, p, &v, gradient != NULL ? &g : NULL));
  if (v.data == NULL || (gradient != NULL && g.data == NULL)) {
    return fail(s->host, MESHRUN_INTERNAL, "byte_mlp: the host lent no storage for parameter '%s'",
                parameter_of(&s->config, p).name);
  }
  *value = float_data(&v);
  if (gradient != NULL) *gradient = float_data(&g);
  return NULL;
}

/* The views of the root's parameters this stage holds; gradients when
 * `backward`. */
static meshrun_error* bind_root(const meshrun_model_stage* s, int backward, root_views* w) {
  const byte_mlp_config* c = &s->config;
  if (s->embed) {
    TRY(view(s, ROLE_EMBED, &w->embed, backward ? &w->d_embed : NULL));
    TRY(view(s, ROLE_EMBED_PREV, &w->embed_prev, backward ? &w->d_embed_prev : NULL));
  }
  if (s->head) {
    TRY(view(s, head_parameter(c, ROLE_HEAD_WEIGHT), &w->head_weight,
             backward ? &w->d_head_weight : NULL));
    TRY(view(s, head_parameter(c, ROLE_HEAD_BIAS), &w->head_bias,
             backward ? &w->d_head_bias : NULL));
  }
  return NULL;
}

static meshrun_error* bind_block(const meshrun_model_stage* s, int64_t l, int backward,
                                 block_views* w) {
  TRY(view(s, block_parameter(l, ROLE_FC1_WEIGHT), &w->w1, backward ? &w->d_w1 : NULL));
  TRY(view(s, block_parameter(l, ROLE_FC1_BIAS), &w->b1, backward ? &w->d_b1 : NULL));
  TRY(view(s, block_parameter(l, ROLE_FC2_WEIGHT), &w->w2, backward ? &w->d_w2 : NULL));
  TRY(view(s, block_parameter(l, ROLE_FC2_BIAS), &w->b2, backward ? &w->d_b2 : NULL));
  return NULL;
}

/* pre_forward (post = 0) or post_forward (post = 1) of block `l` over
 * `hidden`, [batch, seq_len, H] in this stage's own buffer, which the host
 * may rewrite in place (a mixed-precision cast). */
static meshrun_error* hidden_hook(const meshrun_model_stage* s, int post, int64_t l,
                                  float* hidden) {
  int64_t shape[3] = {s->batch, s->seq_len, s->config.hidden_size};
  DLTensor tensor = {.data = hidden,
                     .device = {kDLCPU, 0},
                     .ndim = 3,
                     .dtype = {kDLFloat, 32, 1},
                     .shape = shape,
                     .strides = NULL,
                     .byte_offset = 0};
  const meshrun_model_hooks* hooks = s->hooks;
  return (post ? hooks->post_forward : hooks->pre_forward)(hooks->context, (int32_t)l, &tensor);
}

/* The forward of model.h's hook order: the root's pre_ first, each block
 * between its own pre_ and post_, the root's post_ last. */
static meshrun_error* run_forward(const meshrun_model_stage* s, microbatch* mb, const float* input,
                                  float* output, double* loss) {
  const int64_t N = rows(s), H = s->config.hidden_size, I = s->config.intermediate_size;
  const int64_t blocks = s->end_block - s->first_block;
  root_views root;
  memset(&root, 0, sizeof root);
  if (holds_root(s)) {
    TRY(s->hooks->pre_forward(s->hooks->context, root_unit(s), NULL));
    TRY(bind_root(s, 0, &root));
  }
  if (s->embed) {
    embed_forward(&root, mb->tokens, s->batch, s->seq_len, H, mb->hidden);
  } else {
    memcpy(mb->hidden, input, (size_t)(N * H) * sizeof(float));
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t l = s->first_block + b;
    float* x = mb->hidden + b * N * H;
    block_views w;
    TRY(hidden_hook(s, 0, l, x));
    TRY(bind_block(s, l, 0, &w));
    block_forward(&w, N, H, I, x, mb->pre_activation + b * N * I, x + N * H, s->row);
    TRY(hidden_hook(s, 1, l, x + N * H));
  }
  const float* last = mb->hidden + blocks * N * H;
  if (s->head) {
    *loss = head_forward(&root, N, H, last, mb->targets, mb->probabilities);
  } else {
    memcpy(output, last, (size_t)(N * H) * sizeof(float));
  }
  if (holds_root(s)) TRY(s->hooks->post_forward(s->hooks->context, root_unit(s), NULL));
  return NULL;
}

/* The backward in reverse hook order, announcing each gradient as soon as
 * it is final: the head's, each block's, the embeddings'. */
static meshrun_error* run_backward(const meshrun_model_stage* s, const microbatch* mb,
                                   float loss_scale, const float* grad_output, float* grad_input) {
  const int64_t N = rows(s), H = s->config.hidden_size, I = s->config.intermediate_size;
  const int64_t blocks = s->end_block - s->first_block;
  const meshrun_model_hooks* hooks = s->hooks;
  float* dx = s->grad_hidden;
  root_views root;
  memset(&root, 0, sizeof root);
  if (holds_root(s)) {
    TRY(hooks->pre_backward(hooks->context, root_unit(s)));
    TRY(bind_root(s, 1, &root));
  }
  if (s->head) {
    head_backward(&root, N, H, mb->hidden + blocks * N * H, mb->targets, mb->probabilities,
                  loss_scale, dx, s->row);
    TRY(hooks->gradient_ready(hooks->context, head_parameter(&s->config, ROLE_HEAD_WEIGHT)));
    TRY(hooks->gradient_ready(hooks->context, head_parameter(&s->config, ROLE_HEAD_BIAS)));
  } else {
    memcpy(dx, grad_output, (size_t)(N * H) * sizeof(float));
  }
  for (int64_t b = blocks - 1; b >= 0; --b) {
    const int64_t l = s->first_block + b;
    block_views w;
    TRY(hooks->pre_backward(hooks->context, (int32_t)l));
    TRY(bind_block(s, l, 1, &w));
    block_backward(&w, N, H, I, mb->hidden + b * N * H, mb->pre_activation + b * N * I, dx, s->row);
    for (int role = ROLE_FC1_WEIGHT; role <= ROLE_FC2_BIAS; ++role) {
      TRY(hooks->gradient_ready(hooks->context, block_parameter(l, role)));
    }
    TRY(hooks->post_backward(hooks->context, (int32_t)l));
  }
  if (s->embed) {
    embed_backward(&root, mb->tokens, s->batch, s->seq_len, H, dx);
    TRY(hooks->gradient_ready(hooks->context, ROLE_EMBED));
    TRY(hooks->gradient_ready(hooks->context, ROLE_EMBED_PREV));
  } else {
    memcpy(grad_input, dx, (size_t)(N * H) * sizeof(float));
  }
  if (holds_root(s)) TRY(hooks->post_backward(hooks->context, root_unit(s)));
  return NULL;
}

/* A microbatch's state for the current shape, in one allocation. */
static microbatch* microbatch_create(const meshrun_model_stage* s, int32_t id) {
  const size_t N = (size_t)rows(s), H = (size_t)s->config.hidden_size;
  const size_t I = (size_t)s->config.intermediate_size;
  const size_t blocks = (size_t)(s->end_block - s->first_block);
  const size_t hidden = (blocks + 1) * N * H, pre = blocks * N * I;
  const size_t probabilities = s->head ? N * VOCAB : 0;
  const size_t ids = (s->embed ? N : 0) + (s->head ? N : 0);
  const size_t bytes =
      sizeof(microbatch) + (hidden + pre + probabilities) * sizeof(float) + ids * sizeof(int32_t);
  microbatch* mb = allocate(s->host, bytes);
  if (mb == NULL) return NULL;
  mb->id = id;
  mb->bytes = (int64_t)bytes;
  mb->hidden = (float*)(mb + 1);
  mb->pre_activation = mb->hidden + hidden;
  mb->probabilities = s->head ? mb->pre_activation + pre : NULL;
  int32_t* id_arrays = (int32_t*)(mb->pre_activation + pre + probabilities);
  mb->tokens = s->embed ? id_arrays : NULL;
  mb->targets = s->head ? id_arrays + (s->embed ? N : 0) : NULL;
  return mb;
}

/* forward (F): checks everything before it allocates, so that a refused call
 * leaves nothing in flight. */
static meshrun_error* byte_mlp_forward(meshrun_model_stage* s, int32_t id, const DLTensor* tokens,
                                       const DLTensor* targets, const DLTensor* input,
                                       DLTensor* output, double* out_loss) {
  if (s == NULL) return &null_handle_error;
  if (out_loss == NULL) {
    return fail(s->host, MESHRUN_INVALID_ARGUMENT, "byte_mlp: forward: out_loss is NULL");
  }
  if (s->batch == 0) {
    return fail(s->host, MESHRUN_FAILED_PRECONDITION, "byte_mlp: forward before set_shape");
  }
  if (find(s, id) != NULL) {
    return fail(s->host, MESHRUN_FAILED_PRECONDITION,
                "byte_mlp: microbatch %d is already in flight: its backward (or discard) comes "
                "before another forward of it",
                (int)id);
  }
  TRY(s->embed ? check_ids(s, tokens, "tokens") : check_hidden(s, input, "input"));
  TRY(s->head ? check_ids(s, targets, "targets") : check_hidden(s, output, "output"));
  microbatch* mb = microbatch_create(s, id);
  if (mb == NULL) return fail(s->host, MESHRUN_INTERNAL, "byte_mlp: out of memory");
  const size_t N = (size_t)rows(s);
  if (s->embed) {
    memcpy(mb->tokens, (const char*)tokens->data + tokens->byte_offset, N * sizeof(int32_t));
  }
  if (s->head) {
    memcpy(mb->targets, (const char*)targets->data + targets->byte_offset, N * sizeof(int32_t));
  }
  double loss = 0.0;
  meshrun_error* error = run_forward(s, mb, s->embed ? NULL : float_data(input),
                                     s->head ? NULL : float_data(output), &loss);
  if (error != NULL) {
    microbatch_destroy(s, mb); /* model.h: the microbatch is dropped */
    return error;
  }
  mb->next = s->in_flight;
  s->in_flight = mb;
  *out_loss = loss;
  return NULL;
}

/* backward (B) of a microbatch in flight, which is freed whatever happens. */
static meshrun_error* byte_mlp_backward(meshrun_model_stage* s, int32_t id, float loss_scale,
                                        const DLTensor* grad_output, DLTensor* grad_input) {
  if (s == NULL) return &null_handle_error;
  microbatch* mb = find(s, id);
  if (mb == NULL) {
    return fail(s->host, MESHRUN_FAILED_PRECONDITION,
                "byte_mlp: backward of microbatch %d without its forward", (int)id);
  }
  if (!s->head) TRY(check_hidden(s, grad_output, "grad_output"));
  if (!s->embed) TRY(check_hidden(s, grad_input, "grad_input"));
  meshrun_error* error = run_backward(s, mb, loss_scale, s->head ? NULL : float_data(grad_output),
                                      s->embed ? NULL : float_data(grad_input));
  unlink_microbatch(s, mb); /* done, or dropped on an error */
  microbatch_destroy(s, mb);
  return error;
}

/* discard: a forward that only evaluated (validation) keeps nothing. */
static meshrun_error* byte_mlp_discard(meshrun_model_stage* s, int32_t id) {
  if (s == NULL) return &null_handle_error;
  microbatch* mb = find(s, id);
  if (mb == NULL) {
    return fail(s->host, MESHRUN_FAILED_PRECONDITION,
                "byte_mlp: discard of microbatch %d, which is not in flight", (int)id);
  }
  unlink_microbatch(s, mb);
  microbatch_destroy(s, mb);
  return NULL;
}

/* activation_bytes: what the microbatches in flight hold, which a pipeline
 * schedule's memory report adds up. */
static meshrun_error* byte_mlp_activation_bytes(meshrun_model_stage* s, int64_t* out_bytes) {
  if (s == NULL) return &null_handle_error;
  if (out_bytes == NULL) {
    return fail(s->host, MESHRUN_INVALID_ARGUMENT, "byte_mlp: activation_bytes: out is NULL");
  }
  int64_t bytes = 0;
  for (const microbatch* mb = s->in_flight; mb != NULL; mb = mb->next) bytes += mb->bytes;
  *out_bytes = bytes;
  return NULL;
}

/* ---- The tables ------------------------------------------------------------ */

/* No backward_input / backward_weight: the host then refuses zero-bubble
 * schedules for this model before a run starts. */
static const meshrun_model_api model_api = {
    .struct_size = sizeof(meshrun_model_api),
    .model_type = "byte_mlp",
    .config_keys = config_keys,
    .extensions = NULL,
    .model_create = byte_mlp_model_create,
    .model_destroy = byte_mlp_model_destroy,
    .describe = byte_mlp_describe,
    .init_parameter = byte_mlp_init_parameter,
    .stage_create = byte_mlp_stage_create,
    .stage_destroy = byte_mlp_stage_destroy,
    .set_shape = byte_mlp_set_shape,
    .forward = byte_mlp_forward,
    .backward = byte_mlp_backward,
    .backward_input = NULL,
    .backward_weight = NULL,
    .discard = byte_mlp_discard,
    .activation_bytes = byte_mlp_activation_bytes,
};

static const meshrun_plugin_api plugin_api = {
    .struct_size = sizeof(meshrun_plugin_api),
    .abi_major = MESHRUN_ABI_VERSION_MAJOR,
    .abi_minor = MESHRUN_ABI_VERSION_MINOR,
    .kind = MESHRUN_PLUGIN_KIND_MODEL,
    .name = "byte_mlp",
    .version = "1.0.0",
    .description = "example out-of-tree model in plain C: a byte-level residual MLP",
    .create = byte_mlp_create,
    .destroy = byte_mlp_destroy,
    .strategy = NULL,
    .schedule = NULL,
    .sidecar = NULL,
    .comm = NULL,
    .extensions = NULL,
    .model = &model_api,
};

/* The one exported symbol (meshrun/plugin.h declares it visible). */
const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &plugin_api; }
