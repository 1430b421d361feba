# What the out-of-tree tests share (sourced): a temporary folder $tmp (kept
# with MESHRUN_KEEP_TMP=1), its install prefix $prefix, no
# MESHRUN_PLUGIN_PATH from the caller, fail() and step().

tmp="$(mktemp -d "${TMPDIR:-/tmp}/meshrun-oot.XXXXXX")"
if [[ "${MESHRUN_KEEP_TMP:-0}" == 1 ]]; then
  trap 'echo "kept $tmp"' EXIT
else
  trap 'rm -rf "$tmp"' EXIT
fi
prefix="$tmp/prefix"
unset MESHRUN_PLUGIN_PATH

fail() {
  echo "FAILED: $*" >&2
  exit 1
}

# Runs a step quietly; on failure shows its output and stops.
step() {
  local what="$1" log
  shift
  log="$tmp/$(tr -c 'a-z0-9\n' '_' <<<"$what").log"
  echo "== $what"
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    fail "$what: '$*' exited with an error (output above)"
  fi
}
