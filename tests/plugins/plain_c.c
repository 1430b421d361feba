/* A plugin written in plain C11 against the installed headers only: a
 * schedule whose instance lives in memory from the host's allocator, and
 * whose errors are its own (malloc'd, freed by its own destroy), because a
 * plugin must be able to report a NULL or unusable host without the host. */
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>

#include "meshrun/plugin.h"

typedef struct plain_error {
  meshrun_error header;
  char text[96];
} plain_error;

static void plain_error_destroy(meshrun_error* error) { free(error); }

static void plain_error_keep(meshrun_error* error) { (void)error; }

static meshrun_error plain_out_of_memory = {sizeof(meshrun_error), MESHRUN_INTERNAL,
                                            "plain_c: out of memory", plain_error_keep};

static meshrun_error* plain_error_make(int32_t code, const char* message) {
  plain_error* error = malloc(sizeof(plain_error));
  if (error == NULL) return &plain_out_of_memory;
  strncpy(error->text, message, sizeof(error->text) - 1);
  error->text[sizeof(error->text) - 1] = '\0';
  error->header.struct_size = sizeof(plain_error);
  error->header.code = code;
  error->header.message = error->text;
  error->header.destroy = plain_error_destroy;
  return &error->header;
}

struct meshrun_plugin_instance {
  const meshrun_host_services* host;
};

static meshrun_error* plain_create(const meshrun_host_services* host,
                                   meshrun_plugin_instance** out) {
  meshrun_plugin_instance* instance;
  if (host == NULL) return plain_error_make(MESHRUN_INVALID_ARGUMENT, "plain_c: host is NULL");
  if (out == NULL) return plain_error_make(MESHRUN_INVALID_ARGUMENT, "plain_c: out is NULL");
  /* struct_size first: nothing else may be read from a table too small. */
  if (host->struct_size < MESHRUN_HOST_SERVICES_SIZE_1_0) {
    return plain_error_make(MESHRUN_INVALID_ARGUMENT, "plain_c: host services table too small");
  }
  if (host->abi_major != MESHRUN_ABI_VERSION_MAJOR) {
    return plain_error_make(MESHRUN_VERSION_MISMATCH, "plain_c: host of another ABI major");
  }
  instance = host->allocate(host->context, sizeof(*instance), alignof(meshrun_plugin_instance));
  if (instance == NULL) {
    return host->make_error(host->context, MESHRUN_INTERNAL, "plain_c: allocation failed");
  }
  instance->host = host;
  *out = instance;
  return NULL;
}

static void plain_destroy(meshrun_plugin_instance* instance) {
  if (instance != NULL) instance->host->deallocate(instance->host->context, instance);
}

/* No generate entry: the host reports UNIMPLEMENTED when asked for actions. */
static const meshrun_schedule_api plain_schedule = {
    sizeof(meshrun_schedule_api), 1, MESHRUN_PLACEMENT_LOOP, 0, NULL, NULL};

static const meshrun_plugin_api plain_api = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_SCHEDULE,
    "plain_c",
    "0.0.1-test",
    "loader test plugin written in plain C: a one-stage looped schedule",
    plain_create,
    plain_destroy,
    NULL,
    &plain_schedule,
    NULL,
    NULL,
    NULL,
    NULL,
};

const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &plain_api; }
