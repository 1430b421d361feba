// Force-included wherever a sanitized build compiles toml++ into meshrun
// (core/CMakeLists.txt, meshrun_toml): toml++ as Debian ships it, built
// with NDEBUG by GCC, whose TOML_ASSERT_ASSUME then checks and assumes
// nothing (GCC 12 has no __builtin_assume). With its debug asserts toml++
// aborts on input its release build refuses cleanly ("[@a]": a key cannot
// start with '@'), and with clang's NDEBUG it would assume instead. A
// sanitized build leaves NDEBUG undefined (scripts/test.sh), so that
// TOML_ASSERT_ASSUME is this no-op.
#pragma once
#define TOML_ASSERT(expr) static_cast<void>(0)
