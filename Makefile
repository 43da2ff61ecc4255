# Thin wrappers over CMake/CTest. `make run` and `make test` install what is missing, configure,
# build, then run the main job / the test suite. `make test` is the plain build and every test in
# it; `make check` (what CI runs) adds the build without MPI, Gloo and CUDA, the unit and
# integration tests under ASan+UBSan, and the threaded parts under TSan (docs/testing.md says what
# runs where and why). `make fuzz` runs the libFuzzer targets.
BUILD_DIR  ?= build
BUILD_TYPE ?= Release
ASAN_DIR   ?= build-asan
TSAN_DIR   ?= build-tsan
NOMPI_DIR  ?= build-nompi
FUZZ_DIR   ?= build-fuzz
FUZZ_SECONDS ?= 60
JOBS       ?= $(shell nproc)
SUDO       := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Every Debian package the build, the tests and the main job need (docs/architecture.md,
# "Dependencies"); the fuzzers' compiler comes with `make fuzz` only.
DEPS := build-essential cmake ninja-build pkg-config ccache \
        liburing-dev libtbb-dev libboost-dev libopenmpi-dev openmpi-bin libgloo-dev libopenblas-dev \
        libgtest-dev libgmock-dev libbenchmark-dev \
        nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libxxhash-dev \
        fio fortunes gnuplot-nox
FUZZ_DEPS := clang-14 libclang-rt-14-dev

ZINF := $(BUILD_DIR)/cli/zinf

.PHONY: deps deps-fuzz configure build test check test-plain test-nompi test-asan test-tsan \
        fuzz run bench format clean

# Installs the packages of $(1) that are missing (with sudo when not root); nothing when all are.
define install_missing
	@missing=$$(for p in $(1); do \
	    dpkg-query -W -f='$${db:Status-Abbrev}' $$p 2>/dev/null | grep -q '^ii' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "make deps: installing" $$missing; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
endef

deps:
	$(call install_missing,$(DEPS))

deps-fuzz:
	$(call install_missing,$(FUZZ_DEPS))

$(BUILD_DIR)/build.ninja: | deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The newcomer's command: the plain build (CUDA too when nvcc is found) and every test in it.
test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) --timeout 600

# What CI runs (.ci/run): `make test`, then the three other configurations below.
check: test test-nompi test-asan test-tsan

test-plain: test

# The build without the optional backends (-DZINF_MPI=OFF -DZINF_GLOO=OFF -DZINF_CUDA=OFF): everything links
# without them and every test that does not need them passes (the mpi and gpu tests are not
# defined there). Most objects are the plain build's, from ccache.
$(NOMPI_DIR)/build.ninja: | deps
	cmake -S . -B $(NOMPI_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DZINF_MPI=OFF \
	  -DZINF_GLOO=OFF -DZINF_CUDA=OFF -DZINF_BENCH=OFF

test-nompi: $(NOMPI_DIR)/build.ninja
	cmake --build $(NOMPI_DIR) -j $(JOBS)
	ctest --test-dir $(NOMPI_DIR) --output-on-failure -j $(JOBS) --timeout 600

# Sanitizer builds: no CUDA (nvcc takes no -fsanitize), no benchmarks; -O2 with line tables only
# (symbolized reports for less compile time and disk than full debug info). Any report fails the
# test that printed it: the flags make findings fatal (-fno-sanitize-recover=all), so do these.
ASAN_OPTS := halt_on_error=1:check_initialization_order=1
SAN_CMAKE := -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1" \
             -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1" -DZINF_CUDA=OFF -DZINF_BENCH=OFF
SAN_ENV := ASAN_OPTIONS=$(ASAN_OPTS):detect_leaks=1 \
           UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
           TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/tsan.supp

$(ASAN_DIR)/build.ninja: | deps
	cmake -S . -B $(ASAN_DIR) $(SAN_CMAKE) -DZINF_SANITIZE=address,undefined

# ASan+UBSan: every unit and integration test but those below; then the mpi tests, under mpirun,
# with leak checking off: OpenMPI leaks from plugins it has unloaded by exit, which LeakSanitizer
# reports as "<unknown module>" and no suppression can name (memory errors still fail them).
#   install.consumer: the installed package is linked by a plain consumer project that knows
#                     nothing of the sanitizer runtime; the plain run covers it.
#   Store.FailingAcceptsPauseInsteadOfSpinning: runs its process out of file descriptors on
#                     purpose; UBSan's vptr check probes memory through a pipe, cannot make one,
#                     and reports every object it checks as invalid (a false finding). The TSan
#                     run keeps it.
#   Trainer.ARefusedAllocationIsAnErrorAndLeavesNoSwap (and its strict twin): asks for 128 GB to
#                     see std::bad_alloc become an error; ASan's operator new never throws, it
#                     ends the process (allocator_may_return_null only covers malloc).
ASAN_SKIP := install\.consumer|Store\.FailingAcceptsPauseInsteadOfSpinning
ASAN_SKIP := $(ASAN_SKIP)|(strict\.)?Trainer\.ARefusedAllocationIsAnErrorAndLeavesNoSwap
test-asan: $(ASAN_DIR)/build.ninja
	cmake --build $(ASAN_DIR) -j $(JOBS)
	$(SAN_ENV) ctest --test-dir $(ASAN_DIR) --output-on-failure -j $(JOBS) --timeout 1200 \
	  -L 'unit|integration' -LE 'mpi|gpu' -E '^($(ASAN_SKIP))$$'
	$(SAN_ENV) ASAN_OPTIONS=$(ASAN_OPTS):detect_leaks=0 ctest --test-dir $(ASAN_DIR) \
	  --output-on-failure -j $(JOBS) --timeout 1200 -L mpi -LE gpu

# TSan: the threaded parts only (the store, the communicators, the scheduler, the engine; label
# unit, plus the Gloo backend's process tests, label tsan); the rest is single-threaded or covered
# by these. MPI is left out (OpenMPI is not instrumented), and comm.bench.* runs the zinf binary,
# which this build does not make.
TSAN_TARGETS := comm_test comm_gloo_test store_test sched_test engine_test
$(TSAN_DIR)/build.ninja: | deps
	cmake -S . -B $(TSAN_DIR) $(SAN_CMAKE) -DZINF_SANITIZE=thread -DZINF_MPI=OFF \
	  -DZINF_TEST_DIRS="comm;store;sched;engine"

# One CPU in the affinity mask (taskset): oneTBB is not instrumented, so TSan cannot see its
# synchronization and reports every parallel_for of the kernels as a race; with one CPU oneTBB
# starts no workers and the kernels run on the calling thread. The threads zinf starts itself
# (ranks, streams, the store's, I/O) still interleave, and TSan finds races by happens-before,
# not by timing: one CPU costs speed, not findings.
TSAN_SKIP := comm\.bench\..*|.*_NOT_BUILT
test-tsan: $(TSAN_DIR)/build.ninja
	cmake --build $(TSAN_DIR) -j $(JOBS) --target $(TSAN_TARGETS)
	$(SAN_ENV) taskset -c 0 ctest --test-dir $(TSAN_DIR) --output-on-failure -j $(JOBS) \
	  --timeout 1200 -L 'unit|tsan' -E '^($(TSAN_SKIP))$$'

# libFuzzer targets (tests/fuzz): clang, ASan+UBSan, each run FUZZ_SECONDS from its seed corpus
# (tests/fuzz/corpus/<target>, copied: what libFuzzer adds stays in $(FUZZ_DIR)). Fails on the
# first crash, leak, sanitizer report or timeout; the input that did it is left in $(FUZZ_DIR).
FUZZ_TARGETS := fuzz_config fuzz_store_frames fuzz_safetensors_read fuzz_safetensors_roundtrip \
                fuzz_ckpt_manifest
$(FUZZ_DIR)/build.ninja: | deps deps-fuzz
	cmake -S . -B $(FUZZ_DIR) $(SAN_CMAKE) -DCMAKE_C_COMPILER=clang-14 \
	  -DCMAKE_CXX_COMPILER=clang++-14 -DZINF_SANITIZE=address,undefined -DZINF_FUZZ=ON \
	  -DZINF_MPI=OFF -DZINF_TEST_DIRS=fuzz

fuzz: $(FUZZ_DIR)/build.ninja
	cmake --build $(FUZZ_DIR) -j $(JOBS) --target $(FUZZ_TARGETS)
	@set -e; for t in $(FUZZ_TARGETS); do \
	  name=$${t#fuzz_}; work=$(FUZZ_DIR)/fuzz-run/$$name; mkdir -p $$work/corpus; \
	  cp tests/fuzz/corpus/$$name/* $$work/corpus/; \
	  echo "make fuzz: $$t for $(FUZZ_SECONDS) s"; \
	  $(SAN_ENV) $(FUZZ_DIR)/tests/fuzz/$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 \
	    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix=$$work/ $$work/corpus \
	    > $$work/log 2>&1 || { tail -n 60 $$work/log; echo "make fuzz: $$t failed"; exit 1; }; \
	  grep -E '^(#[0-9]+.*DONE|stat::)' $$work/log || true; \
	done

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
	rm -rf $(BUILD_DIR) $(ASAN_DIR) $(TSAN_DIR) $(FUZZ_DIR)
