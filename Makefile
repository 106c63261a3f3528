# The two commands a new user needs: `make test` and `make demo`. Both install what is missing.
BUILD ?= build
JOBS ?= $(shell nproc)
DEB_PACKAGES := cmake ninja-build g++ pkg-config nlohmann-json3-dev libcli11-dev libyaml-cpp-dev libfmt-dev \
                libgtest-dev libgmock-dev libopenblas-dev libpcre2-dev libutf8proc-dev libopenmpi-dev openmpi-bin libgloo-dev \
                libprotobuf-dev protobuf-compiler libisal-dev \
                python3 python3-pip
# pyarrow: its wheel brings Apache Arrow's C++ libraries, which spindle's Parquet/Arrow --data reader
# builds against (Debian packages no Arrow; without pyarrow the build succeeds without that reader).
PY_PACKAGES := numpy safetensors tokenizers jinja2 tensorboard pyarrow
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build test demo clean

all: build

deps: $(BUILD)/.deps-stamp

$(BUILD)/.deps-stamp: Makefile
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; fi
	@python3 -c "import numpy, safetensors, tokenizers, jinja2, tensorboard, pyarrow" 2>/dev/null || \
	  python3 -m pip install -q $(PY_PACKAGES) || python3 -m pip install -q --break-system-packages $(PY_PACKAGES)
	@mkdir -p $(BUILD) && touch $@

# Configured again after the dependencies change, so that a newly installed pyarrow is found.
$(BUILD)/build.ninja: CMakeLists.txt $(BUILD)/.deps-stamp
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# A real fine-tune of a tiny random-init model on the CPU in about a minute (see demo/run_demo.py).
demo: build
	python3 demo/run_demo.py --spindle $(BUILD)/src/cli/spindle

clean:
	rm -rf $(BUILD)
