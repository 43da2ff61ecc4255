#!/usr/bin/env bash
# Prepares bench/gpu_check.sh for a GPU machine that cannot install packages (no network):
# downloads, on a machine that can, into .gpudeps/ (ignored by git) the Debian packages zinf's
# CUDA build needs beyond CUDA, CMake and ninja, and the fortunes corpus the GPT trains on, about
# 27 MB. Copy the checkout with .gpudeps/ to the GPU machine; gpu_check.sh unpacks them into a
# prefix of its own (dpkg -x, nothing installed) and builds against it, without MPI and Gloo.
#
#   bash bench/gpu_deps.sh            then, on the GPU machine: bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(liburing-dev liburing2 libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
      libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libopenblas0 libgfortran5
      libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libspdlog1.10
      libfmt-dev libfmt9 libxxhash-dev libxxhash0 libboost1.74-dev pkgconf pkgconf-bin libpkgconf3 fortunes fortunes-min)
mkdir -p .gpudeps
(cd .gpudeps && apt-get download "${PKGS[@]}")
du -sh .gpudeps
