// A sanitized meshrun never unmaps a shared library. LeakSanitizer reports
// at process exit; by then Open MPI has closed the components it loaded in
// MPI_Init (and meshrun its plugins), so an allocation stack through them
// would read "<unknown module>" and no suppression in
// tests/sanitize/lsan.supp could name the library it came from. This
// definition, exported from every sanitized executable, takes the place of
// libc's dlclose for the whole process. Plain builds compile nothing here.
// An executable pulls this file out of libmeshrun_core.a by the marker
// symbol (-Wl,--undefined, CMakeLists.txt): dlclose alone would not, since
// the ASan runtime the executable links first already defines it.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)  // clang's way of saying it
#define MESHRUN_ADDRESS_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(MESHRUN_ADDRESS_SANITIZER)

extern "C" __attribute__((visibility("default"))) const int meshrun_sanitized_keep_loaded = 1;

extern "C" __attribute__((visibility("default"))) int dlclose(void* /*handle*/) noexcept {
  return 0;
}

#endif
