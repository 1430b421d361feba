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
  # Open MPI, whose world a GPU run's trainer joins and whose mpirun starts
  # its ranks: the library, mpirun and the compiler wrappers, and what they
  # load, without the network transports (UCX, libfabric, PSM), which one
  # node does not need (`use` restricts Open MPI to shared memory).
  openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libhwloc15 libudev1
  libevent-2.1-7 libevent-core-2.1-7 libevent-pthreads-2.1-7 libmunge2 libltdl7
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
  gpu_deps_use_mpi "$prefix/usr"
}

# Open MPI unpacked under `$1` (its /usr): the names Debian's alternatives
# would have made (mpirun, mpicc, mpicxx), OPAL_PREFIX so that it finds its
# components and help files there, and one node's transports only.
gpu_deps_use_mpi() {
  local usr="$1" name
  [ -x "$usr/bin/orterun" ] || return 0
  for name in mpirun mpiexec; do ln -sf orterun "$usr/bin/$name"; done
  for name in mpicc mpicxx mpic++; do ln -sf opal_wrapper "$usr/bin/$name"; done
  export OPAL_PREFIX="$usr"
  export LD_LIBRARY_PATH="$usr/lib/x86_64-linux-gnu/openmpi/lib:$LD_LIBRARY_PATH"
  export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_mca_base_component_show_load_errors=0
}

case "${1:-}" in
  fetch) gpu_deps_fetch ;;
  use) gpu_deps_use ;;
  *)
    echo "usage: scripts/gpu-deps.sh fetch | source scripts/gpu-deps.sh use" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
