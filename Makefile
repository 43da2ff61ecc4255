# Thin wrappers over CMake/CTest. `make run` and `make test` install what is missing, configure,
# build, then run the main job / the test suite.
BUILD_DIR  ?= build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc)
SUDO       := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Every Debian package the project needs (DESIGN.md, "Dependencies").
DEPS := build-essential cmake ninja-build pkg-config ccache \
        liburing-dev libtbb-dev libboost-dev libopenmpi-dev openmpi-bin libopenblas-dev \
        libgtest-dev libgmock-dev libbenchmark-dev \
        nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libxxhash-dev \
        fio fortunes gnuplot-nox

ZINF := $(BUILD_DIR)/cli/zinf

.PHONY: deps configure build test run bench format clean

deps:
	@missing=$$(for p in $(DEPS); do \
	    dpkg-query -W -f='$${db:Status-Abbrev}' $$p 2>/dev/null | grep -q '^ii' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "make deps: installing" $$missing; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(BUILD_DIR)/build.ninja: | deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) --timeout 600

# The main job: the GPT `small` preset, 2 ranks, ZeRO-3, parameters and optimizer state on NVMe
# under ./.zinf/swap with small device/host budgets; about two minutes on 2 cores.
run: build
	mkdir -p .zinf/swap
	$(ZINF) train --model small --ranks 2 --stage 3 \
	  --offload-param nvme --offload-optimizer nvme --nvme-path .zinf/swap \
	  --device-mem 64M --host-mem 64M --batch 8 --steps 1200 --lr 6e-3 --sample 400

bench: build
	bash bench/run_all.sh $(BUILD_DIR)

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)
