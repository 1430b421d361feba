/*
 * meshrun/error.h — error objects, ABI version and extension lists shared by
 * the host API (meshrun/host.h) and the plugin API (meshrun/plugin.h).
 *
 * Every function of the meshrun C ABI returns `meshrun_error*`: NULL means
 * success; anything else is an error object owned by the caller, who must
 * release it with `err->destroy(err)` (or meshrun_error_release(), which also
 * accepts NULL). Whoever creates an error provides its destroy function, so an
 * error made inside a plugin is freed by the plugin's own allocator.
 *
 * C11, fixed-width types only; compiles with -std=c11 -pedantic -Werror.
 */
#ifndef MESHRUN_ERROR_H_
#define MESHRUN_ERROR_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ABI version. The major changes when a function or field is removed,
 * reordered or retyped; the minor when something is added at the end of a
 * table or struct. A loader refuses another major, and a minor older than
 * MESHRUN_ABI_VERSION_MINOR_OLDEST. */
#define MESHRUN_ABI_VERSION_MAJOR 1
#define MESHRUN_ABI_VERSION_MINOR 14
#define MESHRUN_ABI_VERSION_MINOR_OLDEST 0

/* Error codes (stored as int32_t wherever they cross the ABI). The names and
 * meanings follow absl/PJRT status codes. */
#define MESHRUN_OK 0                  /* never carried by an error object */
#define MESHRUN_INVALID_ARGUMENT 1    /* bad input: config, sizes, NULL pointers */
#define MESHRUN_NOT_FOUND 2           /* unknown plugin, axis, file or key */
#define MESHRUN_FAILED_PRECONDITION 3 /* call made in the wrong lifecycle state */
#define MESHRUN_OUT_OF_RANGE 4        /* rank or index beyond its bound */
#define MESHRUN_UNIMPLEMENTED 5       /* optional feature or extension missing */
#define MESHRUN_VERSION_MISMATCH 6    /* ABI major/minor outside the supported range */
#define MESHRUN_INTERNAL 7            /* a bug or an unexpected failure */
#define MESHRUN_UNAVAILABLE 8         /* a peer or resource is gone */
#define MESHRUN_DEADLINE_EXCEEDED 9   /* a timeout expired */

/* An error. `message` is UTF-8, NUL-terminated, owned by the error and valid
 * until `destroy` is called. `destroy` frees the error and everything it owns;
 * it is never NULL. Producers may allocate a larger struct (struct_size tells)
 * to carry more fields after these. */
typedef struct meshrun_error {
  size_t struct_size;
  int32_t code;
  const char* message;
  void (*destroy)(struct meshrun_error* self);
} meshrun_error;

/* Releases an error through its own destroy function; NULL is accepted. */
static inline void meshrun_error_release(meshrun_error* error) {
  if (error != NULL && error->destroy != NULL) error->destroy(error);
}

/* A node of an extension list. Optional features hang off a table's
 * `extensions` pointer as a singly linked list of structs that each begin
 * with this header; `type` says which struct it is (MESHRUN_EXTENSION_*
 * values, assigned by the project), `struct_size` how large it is. A reader
 * skips types it does not know; a missing extension means the feature is
 * UNIMPLEMENTED, never a crash. Lists are owned by whoever owns the table. */
typedef struct meshrun_extension {
  size_t struct_size;
  int32_t type;
  const struct meshrun_extension* next;
} meshrun_extension;

/* Returns the first extension of `type` in `list`, or NULL if there is none. */
static inline const meshrun_extension* meshrun_extension_find(const meshrun_extension* list,
                                                              int32_t type) {
  for (; list != NULL; list = list->next) {
    if (list->type == type) return list;
  }
  return NULL;
}

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_ERROR_H_ */
