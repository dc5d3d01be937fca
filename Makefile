# The two commands of the README: `make demo` (set up, build, train the default model) and
# `make test` (set up, build, run every test). `make sanitize`: the unit and dist tests under address +
# undefined-behaviour sanitizers (CMakePresets.json "sanitize", in build-sanitize), the bounded fuzz runs included
# (label fuzz, tests/fuzz). `make fuzz`: the long fuzz run (scripts/fuzz.sh; FUZZ_RUNS inputs per harness).
BUILD ?= build
JOBS ?= 2
# Sanitizer runtime options: stop at the first error. Leak checking runs for the unit tests; under mpirun it is off,
# because OpenMPI's own allocations (kept until exit, in components it unloads) cannot be told apart from ours.
SANITIZE_ENV = ASAN_OPTIONS=check_initialization_order=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

.PHONY: setup build demo test sanitize fuzz format clean

setup:
	bash scripts/setup.sh

build: setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	bash scripts/demo.sh $(BUILD)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

sanitize: setup
	cmake --preset sanitize
	cmake --build --preset sanitize -j $(JOBS)
	$(SANITIZE_ENV) ctest --preset sanitize-unit -j $(JOBS)
	$(SANITIZE_ENV) ASAN_OPTIONS=detect_leaks=0:check_initialization_order=1 ctest --preset sanitize-dist -j $(JOBS)

FUZZ_TARGETS = fuzz_flags fuzz_indexed_dataset fuzz_preprocess fuzz_safetensors fuzz_hf_config fuzz_npy \
	fuzz_sharded_checkpoint fuzz_run_report
fuzz: setup
	cmake --preset sanitize
	cmake --build --preset sanitize -j $(JOBS) --target $(FUZZ_TARGETS)
	$(SANITIZE_ENV) bash scripts/fuzz.sh build-sanitize

format:
	find src apps tests bench -name '*.h' -o -name '*.cpp' | xargs clang-format -i

clean:
	rm -rf $(BUILD) build-sanitize
