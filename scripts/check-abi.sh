#!/usr/bin/env bash
# Compares meshrun's exported C ABI with the committed baseline (abi/baseline/).
#
#   scripts/check-abi.sh [check|update] [--lib LIBMESHRUN] [--plugin PLUGIN] [--kit LIBKIT]
#
# Dumps, with abidw, the ABI of libmeshrun.so (the host API), of one shipped
# plugin (its meshrun_plugin_get_api reaches every plugin-ABI struct) and of
# libmeshrun_kit.so (the model kit, meshrun/kit.h), keeping
# only types defined in abi/include/meshrun/. `check` (the default) compares
# the dumps with abi/baseline/<library>.abi; `update` rewrites the baselines.
#
# check fails on an incompatible change: a removed function, a changed
# signature, a struct member removed, moved or retyped, a struct that did not
# grow. An additive change (new functions, members appended at the end of a
# struct that grows) passes with a note: bump MESHRUN_ABI_VERSION_MINOR, then
# run `scripts/check-abi.sh update`. See docs/abi.md.
#
# Exit status: 0 compatible, 1 incompatible or error, 77 when a library has no
# debug info (the dump needs it; build RelWithDebInfo or Debug).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
headers="$root/abi/include/meshrun"
baseline_dir="$root/abi/baseline"
lib="$root/build/lib/libmeshrun.so"
plugin="$root/build/lib/meshrun/plugins/meshrun_strategy_ddp.so"
kit="$root/build/lib/libmeshrun_kit.so"
mode=check

usage() {
  echo "usage: $0 [check|update] [--lib LIBMESHRUN] [--plugin PLUGIN] [--kit LIBKIT]" >&2
  exit 1
}

while (($#)); do
  case "$1" in
    check | update) mode="$1" ;;
    --lib) lib="${2:?--lib needs a path}"; shift ;;
    --plugin) plugin="${2:?--plugin needs a path}"; shift ;;
    --kit) kit="${2:?--kit needs a path}"; shift ;;
    -h | --help) usage ;;
    *) echo "check-abi: unknown argument '$1'" >&2; usage ;;
  esac
  shift
done

for tool in abidw abidiff readelf; do
  if ! command -v "$tool" >/dev/null; then
    echo "check-abi: $tool not found (Debian packages abigail-tools and binutils)" >&2
    exit 1
  fi
done

tmp="$(mktemp -d "${TMPDIR:-/tmp}/meshrun-abi.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# Writes the ABI dump of $1 to $2. Only what is stable across builds is kept:
# no source locations, corpus or compilation paths, DT_NEEDED entries or
# architecture; type ids are content hashes, so an addition does not renumber
# every other type. Translation-unit paths are made relative to the source root.
dump() {
  local binary="$1" out="$2"
  if [[ ! -f "$binary" ]]; then
    echo "check-abi: $binary does not exist; build first (cmake --build build)" >&2
    exit 1
  fi
  local sections
  sections="$(readelf --section-headers --wide "$binary")"
  if [[ "$sections" != *" .debug_info "* ]]; then
    echo "check-abi: SKIPPED: $binary has no debug info, which abidw needs;" \
      "build with CMAKE_BUILD_TYPE=RelWithDebInfo (the default) or Debug" >&2
    exit 77
  fi
  abidw --headers-dir "$headers" --drop-private-types --exported-interfaces-only \
    --no-corpus-path --no-comp-dir-path --no-show-locs --no-elf-needed --no-architecture \
    --type-id-style hash --out-file "$tmp/raw.abi" "$binary"
  sed "s|path='$root/|path='|" "$tmp/raw.abi" >"$out"
}

# Reads `abidiff --leaf-changes-only --no-added-syms` output and prints every
# leaf change that is not an append to a struct; succeeds when there is none.
# A struct change is an append when the struct grows and every member inserted
# lies at or beyond its old size. A struct that keeps its size cannot take a
# new member: its struct_size would not tell old from new. Anything not
# recognised counts as incompatible.
only_appends() {
  awk '
    function flush() {
      if (block != "" && !ok) { print block; found = 1 }
      block = ""
    }
    /^(Leaf changes summary|Changed leaf types summary|Removed\/Changed\/Added (functions|variables) summary|(Function|Variable) symbols changes summary):/ { next }
    /^$/ { next }
    /^[^ ]/ {
      flush()
      block = $0
      ok = ($0 ~ /^'\''struct [A-Za-z0-9_]+'\'' changed:$/)
      old_size = -1
      next
    }
    { block = block "\n" $0 }
    ok && /^  type size changed from [0-9]+ to [0-9]+ \(in bits\)$/ {
      old_size = $5 + 0
      if ($7 + 0 <= old_size) ok = 0
      next
    }
    ok && /^  [0-9]+ data member insertions?:$/ { next }
    ok && /^    '\''.*'\'', at offset [0-9]+ \(in bits\)$/ {
      offset = $0
      sub(/.*, at offset /, "", offset)
      sub(/ .*/, "", offset)
      if (old_size < 0 || offset + 0 < old_size) ok = 0
      next
    }
    { ok = 0 }
    END { flush(); exit found }
  '
}

# Compares the dump of $2 with the baseline named $1; sets status=1 when the
# change is incompatible or cannot be checked.
status=0
check_one() {
  local name="$1" binary="$2"
  local baseline="$baseline_dir/$name.abi" current="$tmp/$name.abi"
  dump "$binary" "$current"
  if [[ ! -f "$baseline" ]]; then
    echo "check-abi: no baseline $baseline; run scripts/check-abi.sh update" >&2
    status=1
    return
  fi
  local rc=0
  abidiff "$baseline" "$current" >"$tmp/$name.report" 2>&1 || rc=$?
  if ((rc == 0)); then
    echo "check-abi: $name: ABI matches the baseline"
    return
  fi
  if ((rc & 3)); then
    echo "check-abi: $name: abidiff failed (status $rc):" >&2
    cat "$tmp/$name.report" >&2
    status=1
    return
  fi
  local reasons=""
  if ((rc & 8)); then
    reasons="a function or variable was removed"
  else
    abidiff --leaf-changes-only --no-added-syms "$baseline" "$current" >"$tmp/$name.leaf" 2>&1 || true
    reasons="$(only_appends <"$tmp/$name.leaf")" || true
  fi
  if [[ -n "$reasons" ]]; then
    {
      echo "check-abi: $name: INCOMPATIBLE ABI change against $baseline:"
      echo "  ${reasons//$'\n'/$'\n'  }"
      echo "abidiff report:"
      cat "$tmp/$name.report"
      echo "If this break is intended, bump MESHRUN_ABI_VERSION_MAJOR (and reset the minor) in"
      echo "abi/include/meshrun/error.h, then run scripts/check-abi.sh update and commit abi/baseline/."
    } >&2
    status=1
    return
  fi
  echo "check-abi: $name: additive ABI change (compatible):"
  sed 's/^/  /' "$tmp/$name.report"
  echo "check-abi: NOTE: bump MESHRUN_ABI_VERSION_MINOR in abi/include/meshrun/error.h (if not"
  echo "  done yet), then run scripts/check-abi.sh update and commit abi/baseline/."
}

# Baseline name of a library: its file name up to ".so" (libmeshrun.so.1 ->
# libmeshrun).
baseline_name() {
  local base
  base="$(basename "$1")"
  echo "${base%%.so*}"
}

for binary in "$lib" "$plugin" "$kit"; do
  name="$(baseline_name "$binary")"
  if [[ "$mode" == update ]]; then
    mkdir -p "$baseline_dir"
    dump "$binary" "$baseline_dir/$name.abi"
    echo "check-abi: wrote $baseline_dir/$name.abi"
  else
    check_one "$name" "$binary"
  fi
done
exit "$status"
