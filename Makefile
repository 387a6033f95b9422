# smp front door. `make demo` and `make test` do everything on a fresh Debian 12 machine.
#
# Torch comes from pip: `make deps` creates the virtual environment $(VENV) holding the
# torch, numpy and pytest pinned in requirements.txt, and everything builds, tests and
# runs with its python. TORCH=debian builds against Debian's torch 1.13 instead (the
# oldest supported; `make test-oldest` runs the whole suite that way in build-torch1.13).
TORCH       ?= pip
VENV        ?= .venv
ifeq ($(TORCH),debian)
PYTHON      ?= /usr/bin/python3
BUILD_DIR   ?= build-torch1.13
else
PYTHON      ?= $(VENV)/bin/python
BUILD_DIR   ?= build
endif
PREFIX      ?= /usr/local
JOBS        ?= $(shell nproc)
# Debian packages the project builds and runs with (see README: "Dependencies").
DEB_PACKAGES := cmake g++ make ninja-build python3-dev python3-venv libgloo-dev \
                libboost-serialization-dev libgtest-dev \
                libcli11-dev nlohmann-json3-dev libxxhash-dev libssl-dev procps iproute2 \
                nftables
ifeq ($(TORCH),debian)
DEB_PACKAGES += libtorch-dev python3-torch pybind11-dev python3-pytest libopenblas0-pthread
endif
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
VENV_STAMP := $(VENV)/.smp-requirements

.PHONY: all deps deb-deps build test test-cpp test-python test-oldest demo bench fuzz install clean

all: build

# Installs only what is missing; runs `apt-get update` only when something is.
deb-deps:
	@missing=$$(for p in $(DEB_PACKAGES); do \
	    dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed$$' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "smp: installing missing packages:" $$missing; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing; \
	else echo "smp: all Debian packages present"; fi

# The environment is (re)built when requirements.txt changes; a half-built one (an
# interrupted pip) has no stamp and is retried. --no-cache-dir: the CUDA build of torch
# and its nvidia-* wheels are ~3 GB; a cached copy beside the 5.4 GB install doubles the
# disk a fresh machine needs, and CI starts without a cache anyway.
$(VENV_STAMP): requirements.txt | deb-deps
	@[ -x $(VENV)/bin/python ] || /usr/bin/python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir -r requirements.txt
	@cp requirements.txt $@

ifeq ($(TORCH),debian)
deps: deb-deps
else
deps: deb-deps $(VENV_STAMP)
endif

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DPython_EXECUTABLE=$(abspath $(PYTHON)) -DCMAKE_INSTALL_PREFIX=$(PREFIX)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

test-cpp: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600

test-python: build
	PYTHONPATH=$(CURDIR)/$(BUILD_DIR)/python SMP_BUILD_DIR=$(CURDIR)/$(BUILD_DIR) \
	  $(PYTHON) -m pytest -q -ra --durations=25 tests/python
	@# Jobs across hosts made of network namespaces (docs/hosts.md): root only, else a
	@# one-line skip.
	PYTHONPATH=$(CURDIR)/$(BUILD_DIR)/python SMP_BUILD_DIR=$(CURDIR)/$(BUILD_DIR) \
	  $(PYTHON) -m pytest -q -ra tests/hosts
	@# The GPU suite (docs/gpu.md) on its own: it skips cleanly where torch sees no GPU.
	PYTHONPATH=$(CURDIR)/$(BUILD_DIR)/python SMP_BUILD_DIR=$(CURDIR)/$(BUILD_DIR) \
	  $(PYTHON) -m pytest -q -ra tests/gpu

test: test-cpp test-python

# The whole suite against the oldest supported torch (Debian's 1.13), in its own build dir.
test-oldest:
	$(MAKE) test TORCH=debian

demo: build
	$(BUILD_DIR)/bin/smprun --nproc_per_node 4 --config '{"partitions": 2, "microbatches": 4, "ddp": true}' \
	  examples/demo.py

bench: build
	PYTHONPATH=$(CURDIR)/$(BUILD_DIR)/python $(PYTHON) bench/run_all.py
	PYTHONPATH=$(CURDIR)/$(BUILD_DIR)/python SMP_BUILD_DIR=$(CURDIR)/$(BUILD_DIR) $(PYTHON) bench/tensor_parallel.py

# libFuzzer targets for the decoders of outside bytes (docs/fuzzing.md): a clang build of
# their own in build-fuzz, then each runs FUZZ_SECONDS on a copy of its corpus; a crash
# leaves its input in build-fuzz/crashes/ and fails the target. `make test` replays the
# checked-in corpus and crashes in the normal build (tests/cpp/fuzz).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := config control_line wire call_meta checkpoint
fuzz:
	@$(MAKE) --no-print-directory deb-deps DEB_PACKAGES="clang-14 libclang-rt-14-dev $(DEB_PACKAGES)"
	cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build-fuzz -j $(JOBS)
	@mkdir -p build-fuzz/crashes
	@set -e; for t in $(FUZZ_TARGETS); do \
	  rm -rf build-fuzz/work/$$t && mkdir -p build-fuzz/work/$$t && cp tests/fuzz/corpus/$$t/* build-fuzz/work/$$t/; \
	  echo "smp: fuzzing $$t for $(FUZZ_SECONDS) s"; \
	  build-fuzz/$${t}_fuzz -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -artifact_prefix=build-fuzz/crashes/$$t- build-fuzz/work/$$t 2>build-fuzz/$$t.log \
	    || { tail -40 build-fuzz/$$t.log; echo "smp: $${t}_fuzz crashed: its input is in build-fuzz/crashes/"; exit 1; }; \
	  grep -E '^stat::(number_of_executed_units|average_exec_per_sec)|DONE' build-fuzz/$$t.log | tail -3; \
	done

# C++ headers, static libraries and CMake package (find_package(smp)) and bin/smprun to
# PREFIX, then the Python packages `smp` and `smdistributed` into $(PYTHON)'s
# site-packages for PREFIX (/usr/local -> /usr/local/lib/python3.X/dist-packages).
# Re-running replaces the previous install. sudo only when PREFIX is not writable.
INSTALL_SUDO = $(shell d="$(PREFIX)"; while [ ! -e "$$d" ]; do d=$$(dirname "$$d"); done; \
                 [ -w "$$d" ] || echo $(SUDO))
install: build
	$(INSTALL_SUDO) cmake --install $(BUILD_DIR) --prefix $(PREFIX)
	$(INSTALL_SUDO) $(PYTHON) tools/install_python.py $(BUILD_DIR)/python --prefix $(PREFIX)

clean:
	rm -rf $(BUILD_DIR) build-fuzz
