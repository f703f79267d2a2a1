# Quick start: `make bench` runs the benchmark suite on the best device present; `make test` runs every test.
# Both install missing prerequisites first (scripts/install-deps) and build with CMake presets.
PRESET ?= release
BUILD_DIR := build/$(PRESET)
JOBS ?= $(shell nproc)
BENCH_ARGS ?=

.PHONY: all deps configure build test bench check info clean

all: build

deps:
	@scripts/install-deps

$(BUILD_DIR)/build.ninja: | deps
	cmake --preset $(PRESET)

configure: deps
	cmake --preset $(PRESET)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	ctest --preset $(PRESET) -j $(JOBS)

bench: build
	$(BUILD_DIR)/tools/cli/attnforge bench $(BENCH_ARGS)

check: build
	$(BUILD_DIR)/tools/cli/attnforge check

info: build
	$(BUILD_DIR)/tools/cli/attnforge info

clean:
	rm -rf build
