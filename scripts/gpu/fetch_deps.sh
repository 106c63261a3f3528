#!/usr/bin/env bash
# Runs on the development machine (Debian, with a package registry), not on the GPU host.
# The GPU host (Ubuntu 24.04) has no package registry and lacks some -dev packages the root
# CMakeLists.txt requires (PCRE2 headers, utf8proc; DESIGN §4). This downloads the .deb files of
# every build dependency into .deps/debs (git-ignored); scripts/gpu/build.sh unpacks, on the host,
# only those whose headers the host lacks. Carry them with the device call: carry: [".deps"].
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
