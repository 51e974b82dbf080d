#!/usr/bin/env bash
# System packages the IREE target tests need (Debian 12 "bookworm").
#   vulkan: Mesa's lavapipe software Vulkan driver (mesa-vulkan-drivers) + vulkaninfo
#   arm64:  qemu-aarch64 user-mode emulator and the arm64 C/C++ runtime libraries that the
#           aarch64 iree-run-module (from the iree-base-runtime aarch64 wheel) links against.
# The aarch64 wheel itself is fetched by pockjax.backends.iree.arm64.ensure_aarch64_runtime()
# (pip download of iree-base-runtime, cached under ~/.cache/pockjax).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO dpkg --add-architecture arm64
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
  mesa-vulkan-drivers vulkan-tools \
  qemu-user \
  libc6:arm64 libstdc++6:arm64
