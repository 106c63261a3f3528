#!/usr/bin/env bash
# Runs on a Debian 12 machine with apt (the development machine), not on the GPU host.
# A GPU host without a package registry may lack some -dev packages the root CMakeLists.txt
# requires (an Ubuntu 24.04 CUDA host lacked the PCRE2 headers and utf8proc). This downloads the
# .deb files of every build dependency into .deps/debs (git-ignored); copy .deps/ to the GPU host
# with the repository, where scripts/gpu/build.sh unpacks only those whose headers the host lacks.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.deps/debs"
mkdir -p "$dest"
cd "$dest"
# -dev packages plus the runtime libraries their .so links point at (dpkg -x does not follow
# dependencies). Headers-only packages need nothing else.
packages=(
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
  libutf8proc-dev libutf8proc2
  libcli11-dev
  libyaml-cpp-dev libyaml-cpp0.7
  nlohmann-json3-dev
  libfmt-dev libfmt9
  libgtest-dev
  libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 protobuf-compiler libprotoc32
  libisal-dev libisal2
)
missing=()
for p in "${packages[@]}"; do
  ls "${p}"_*.deb >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  # apt-get download runs as the calling user; the _apt sandbox warning when root is harmless.
  apt-get download "${missing[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true
fi
for p in "${packages[@]}"; do
  ls "${p}"_*.deb >/dev/null 2>&1 || { echo "fetch_deps: could not download $p" >&2; exit 1; }
done
du -sh "$dest"
