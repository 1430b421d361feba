// Force-included into the fuzz build: toml++ as Debian ships it, built with
// NDEBUG by GCC, whose TOML_ASSERT_ASSUME then checks and assumes nothing
// (GCC 12 has no __builtin_assume). With its debug asserts toml++ aborts on
// input its release build refuses cleanly ("[@a]": a key cannot start
// with '@'), and with clang's NDEBUG it would assume instead.
#pragma once
#define TOML_ASSERT(expr) static_cast<void>(0)
