/* A shared library named like a plugin that does not export the entry
 * symbol: what the loader meets when a file is not a meshrun plugin. */
__attribute__((visibility("default"))) int meshrun_not_the_entry_point(void) { return 0; }
