#!/usr/bin/env bash
# The Debian packages a GPU build needs that the GPU machines lack. Those
# machines (the device tool's) run an image with CUDA, CMake, ninja, g++
# and Python but none of meshrun's Debian build dependencies, and reach no
# package registry; so the packages are fetched here and travel with the
# working tree.
#
#   scripts/gpu-deps.sh fetch        # here (Debian 12, registry reachable):
#                                    # downloads the .debs into .gpu-deps/
#   source scripts/gpu-deps.sh use   # there: unpacks .gpu-deps/*.deb into
#                                    # $MESHRUN_GPU_DEPS_PREFIX (default
#                                    # /tmp/meshrun-gpu-deps), never into /,
#                                    # and exports the search paths CMake,
#                                    # pkg-config, the compiler and the loader
#                                    # need to find them first
#
# .gpu-deps/ is ignored by git: a device run names it in `carry`.
# scripts/gpu-check.sh calls `use` itself when .gpu-deps/ holds packages.
packages=(
  libfmt-dev libfmt9 libtomlplusplus-dev libtomlplusplus3 nlohmann-json3-dev libdlpack-dev
  libxxhash-dev libxxhash0 libdnnl-dev libdnnl2 ocl-icd-libopencl1 catch2
  libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libgfortran5
  pkgconf pkgconf-bin libpkgconf3
)
gpu_deps_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.gpu-deps"

gpu_deps_fetch() {
  mkdir -p "$gpu_deps_dir"
  (cd "$gpu_deps_dir" && apt-get download "${packages[@]}")
  du -sh "$gpu_deps_dir"
}

gpu_deps_use() {
  local prefix="${MESHRUN_GPU_DEPS_PREFIX:-/tmp/meshrun-gpu-deps}"
  local deb
  mkdir -p "$prefix"
  for deb in "$gpu_deps_dir"/*.deb; do dpkg -x "$deb" "$prefix"; done
  local lib="$prefix/usr/lib/x86_64-linux-gnu"
  export CMAKE_PREFIX_PATH="$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export CPATH="$prefix/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$lib:$lib/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The packages' .pc files say prefix=/usr: the sysroot puts them under
  # the unpacked tree.
  export PKG_CONFIG="$prefix/usr/bin/pkgconf"
  export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$lib/openblas-pthread/pkgconfig:$prefix/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$prefix"
  export PATH="$prefix/usr/bin:$PATH"
  export MESHRUN_SKIP_INSTALL_DEPS=1
}

case "${1:-}" in
  fetch) gpu_deps_fetch ;;
  use) gpu_deps_use ;;
  *)
    echo "usage: scripts/gpu-deps.sh fetch | source scripts/gpu-deps.sh use" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
