/*
 * example_c — a meshrun strategy plugin in plain C11.
 *
 * It shows the whole plugin ABI contract (docs/abi.md) with nothing but the
 * installed headers: one exported symbol returning a static table, a size
 * check of the host services table, errors made by the host's make_error,
 * memory from the host's allocator, and a destroy that accepts NULL. As a
 * strategy it only declares its mesh family (FSDP2); ABI 1.0 reserves the
 * rest of the strategy table for later minors.
 */
#include <stddef.h>

#include "meshrun/plugin.h"

/* The instance state. The host services table is borrowed until destroy. */
struct meshrun_plugin_instance {
  const meshrun_host_services* host;
};

/* When the host table is missing or too small, its make_error cannot be
 * trusted, so these two errors are static: their destroy frees nothing. */
static void static_error_destroy(meshrun_error* error) { (void)error; }

static meshrun_error null_host_error = {sizeof(meshrun_error), MESHRUN_INVALID_ARGUMENT,
                                        "example_c: host services table is NULL",
                                        static_error_destroy};

static meshrun_error small_host_error = {
    sizeof(meshrun_error), MESHRUN_INVALID_ARGUMENT,
    "example_c: host services table is smaller than ABI 1.0 requires", static_error_destroy};

static meshrun_error* example_create(const meshrun_host_services* host,
                                     meshrun_plugin_instance** out) {
  if (host == NULL) return &null_host_error;
  /* Accept any table at least as large as the 1.0 one: a newer host's table
   * is larger, and its extra fields are simply not read here. */
  if (host->struct_size < MESHRUN_HOST_SERVICES_SIZE_1_0) return &small_host_error;
  if (host->abi_major != MESHRUN_ABI_VERSION_MAJOR) {
    return host->make_error(host->context, MESHRUN_VERSION_MISMATCH,
                            "example_c: host ABI major differs from the one this plugin was "
                            "built for");
  }
  if (out == NULL) {
    return host->make_error(host->context, MESHRUN_INVALID_ARGUMENT,
                            "example_c: create: out is NULL");
  }
  meshrun_plugin_instance* instance =
      host->allocate(host->context, sizeof *instance, _Alignof(meshrun_plugin_instance));
  if (instance == NULL) {
    return host->make_error(host->context, MESHRUN_INTERNAL, "example_c: out of memory");
  }
  instance->host = host;
  host->log(host->context, MESHRUN_LOG_DEBUG, "example_c: instance created");
  *out = instance;
  return NULL;
}

static void example_destroy(meshrun_plugin_instance* instance) {
  if (instance == NULL) return;
  const meshrun_host_services* host = instance->host;
  host->deallocate(host->context, instance);
}

static const meshrun_strategy_api strategy_api = {
    .struct_size = sizeof(meshrun_strategy_api),
    .mesh_family = MESHRUN_MESH_FAMILY_FSDP2,
    .extensions = NULL,
};

static const meshrun_plugin_api plugin_api = {
    .struct_size = sizeof(meshrun_plugin_api),
    .abi_major = MESHRUN_ABI_VERSION_MAJOR,
    .abi_minor = MESHRUN_ABI_VERSION_MINOR,
    .kind = MESHRUN_PLUGIN_KIND_STRATEGY,
    .name = "example_c",
    .version = "1.0.0",
    .description = "example out-of-tree strategy in plain C (FSDP2 mesh)",
    .create = example_create,
    .destroy = example_destroy,
    .strategy = &strategy_api,
    .schedule = NULL,
    .sidecar = NULL,
    .comm = NULL,
    .extensions = NULL,
    .model = NULL,
};

const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &plugin_api; }
