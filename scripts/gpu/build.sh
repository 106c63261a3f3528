#!/usr/bin/env bash
# Runs on the GPU host (Ubuntu 24.04, CUDA 13, no package registry needed). Unpacks, from the .deb
# files that scripts/gpu/fetch_deps.sh downloaded into .deps/debs on a Debian machine (copy .deps/
# to the host with the repository), only the build dependencies whose headers the host lacks,
# points CMake / pkg-config / the compiler at them, then configures and builds into build-gpu/;
# build-gpu/deps_env.sh sets LD_LIBRARY_PATH for running what was built.
# Usage: scripts/gpu/build.sh [target...]   (default: everything)
# Env: BUILD_DIR (default build-gpu), BUILD_TYPE (default Release), CUDA_ARCH (default 90a).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
debs="$root/.deps/debs"
deps=/tmp/spindle-deps
build_dir="${BUILD_DIR:-$root/build-gpu}"
mkdir -p "$deps"

[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || { echo "build.sh: nvcc not found" >&2; exit 1; }

# unpack <package-glob...>: dpkg -x into $deps (never into /, which other packages own).
unpack() {
  local g f
  for g in "$@"; do
    for f in "$debs"/${g}_*.deb; do
      [[ -f "$f" ]] || { echo "build.sh: $g needed but not in $debs (run scripts/gpu/fetch_deps.sh)" >&2; exit 1; }
      dpkg -x "$f" "$deps"
      echo "build.sh: unpacked $(basename "$f")"
    done
  done
}
[[ -f /usr/include/pcre2.h ]] || unpack libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
[[ -f /usr/include/utf8proc.h ]] || unpack libutf8proc-dev libutf8proc2
[[ -f /usr/include/CLI/CLI.hpp ]] || unpack libcli11-dev
[[ -f /usr/include/yaml-cpp/yaml.h ]] || unpack libyaml-cpp-dev libyaml-cpp0.7
[[ -f /usr/include/nlohmann/json.hpp ]] || unpack nlohmann-json3-dev
[[ -f /usr/include/fmt/format.h ]] || unpack libfmt-dev libfmt9
[[ -f /usr/include/gtest/gtest.h ]] || unpack libgtest-dev
pkg-config --exists openblas || unpack libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread
# protoc must match the protobuf headers, so both come from the same packages.
[[ -f /usr/include/google/protobuf/message_lite.h ]] && command -v protoc >/dev/null ||
  unpack libprotobuf-dev libprotobuf32 libprotobuf-lite32 protobuf-compiler libprotoc32
[[ -f /usr/include/isa-l.h ]] || unpack libisal-dev libisal2

# The unpacked .pc files say prefix=/usr (or spell /usr/... out): move them to $deps/usr.
lib="$deps/usr/lib/x86_64-linux-gnu"
for pc in "$lib"/pkgconfig/*.pc "$lib"/openblas-pthread/pkgconfig/*.pc "$deps"/usr/share/pkgconfig/*.pc; do
  [[ -f "$pc" ]] || continue
  sed -i -E "s#^(prefix|exec_prefix|libdir|includedir)=/usr#\1=$deps/usr#" "$pc"
done
# dpkg -x does not run the alternatives that make libopenblas.so visible in the plain lib folder.
if [[ -d "$lib/openblas-pthread" && ! -e "$lib/libopenblas.so" ]]; then
  ln -sf openblas-pthread/libopenblas.so "$lib/libopenblas.so"
  ln -sf openblas-pthread/libopenblas.so.0 "$lib/libopenblas.so.0"
fi
export CMAKE_PREFIX_PATH="$deps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
[[ -x "$deps/usr/bin/protoc" ]] && export PATH="$deps/usr/bin:$PATH"
export PKG_CONFIG_PATH="$lib/pkgconfig:$lib/openblas-pthread/pkgconfig:$deps/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export CPATH="$deps/usr/include:$deps/usr/include/x86_64-linux-gnu/openblas-pthread${CPATH:+:$CPATH}"
export LIBRARY_PATH="$lib:$lib/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# The runtime half of this environment, for scripts that run what was built (source it).
mkdir -p "$build_dir"
printf 'export LD_LIBRARY_PATH="%s"\n' "$LD_LIBRARY_PATH" > "$build_dir/deps_env.sh"

cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a}" -DSPINDLE_CUDA=ON
if (($#)); then
  cmake --build "$build_dir" --target "$@"
else
  cmake --build "$build_dir"
fi
