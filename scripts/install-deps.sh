#!/usr/bin/env bash
# Installs the Debian packages meshrun builds and tests with, when any is
# missing (Debian 12). Needs root or sudo only when something must be installed.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config python3
  libfmt-dev libtomlplusplus-dev libdlpack-dev nlohmann-json3-dev catch2
  libopenmpi-dev openmpi-bin libopenblas-dev libdnnl-dev libxxhash-dev abigail-tools clang-format
  clang libclang-rt-dev
  python3-numpy python3-torch
  # pip install ./python into a venv, offline (tests/python/test_pip_install.py).
  python3-venv python3-pip python3-setuptools python3-wheel
  # The Rust bindings (bindings/rust): Debian's toolchain, used offline.
  cargo bindgen
  # A one-node Slurm for the srun test (tests/slurm/start-slurm.sh); libpmix-dev
  # holds the libpmix.so Slurm's pmix plugin loads.
  munge slurmctld slurmd slurm-client libpmix-dev
)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "meshrun: installing missing Debian packages: ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "meshrun: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
# Services the packages bring (munge, slurmctld, slurmd) stay stopped: the
# tests start their own. Where no policy says so, one does for this install.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | "${sudo_cmd[@]}" tee /usr/sbin/policy-rc.d >/dev/null
  "${sudo_cmd[@]}" chmod 755 /usr/sbin/policy-rc.d
  trap '"${sudo_cmd[@]}" rm -f /usr/sbin/policy-rc.d' EXIT
fi
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
