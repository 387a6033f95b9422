# smp front door. `make demo` and `make test` do everything on a fresh Debian 12 machine.
PYTHON      ?= /usr/bin/python3
BUILD_DIR   ?= build
PREFIX      ?= /usr/local
JOBS        ?= $(shell nproc)
# Debian packages the project builds and runs with (see README: "Dependencies").
DEB_PACKAGES := cmake g++ make ninja-build libtorch-dev python3-torch libgloo-dev pybind11-dev \
                libboost-serialization-dev libgtest-dev python3-pytest libopenblas0-pthread \
                libcli11-dev nlohmann-json3-dev libxxhash-dev procps iproute2
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build test test-cpp test-python demo bench install clean

all: build

# Installs only what is missing; runs `apt-get update` only when something is.
deps:
	@missing=$$(for p in $(DEB_PACKAGES); do \
	    dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed$$' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "smp: installing missing packages:" $$missing; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing; \
	else echo "smp: all Debian packages present"; fi

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DPython_EXECUTABLE=$(PYTHON) -DCMAKE_INSTALL_PREFIX=$(PREFIX)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

test-cpp: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600

test-python: build
	PYTHONPATH=$(CURDIR)/$(BUILD_DIR)/python SMP_BUILD_DIR=$(CURDIR)/$(BUILD_DIR) \
	  $(PYTHON) -m pytest -q -ra tests/python

test: test-cpp test-python

demo: build
	$(BUILD_DIR)/bin/smprun --nproc_per_node 4 --config '{"partitions": 2, "microbatches": 4, "ddp": true}' \
	  examples/demo.py

bench: build
	PYTHONPATH=$(CURDIR)/$(BUILD_DIR)/python $(PYTHON) bench/run_all.py

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
	rm -rf $(BUILD_DIR)
