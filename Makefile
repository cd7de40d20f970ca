# The two commands of the README. meson does the building; this file only makes sure the
# tools and libraries are there first and gives the steps names.
BUILD ?= build
MESON_OPTS ?= -Dwerror=true

.PHONY: all deps build test fuzz demo bench clean

all: build

deps:
	@scripts/deps.sh

build: deps
	@[ -f $(BUILD)/build.ninja ] || meson setup $(BUILD) $(MESON_OPTS)
	@ninja -C $(BUILD)

# The format check, every suite of the plain build, unit+fuzz+integration on an ASan+UBSan
# build, integration on a ThreadSanitizer build; always ends with "tests: N passed, N failed,
# N skipped" (scripts/test.sh). It builds the plain tree itself, so that a build that fails
# still gets that closing line.
test: deps
	@MESON_OPTS="$(MESON_OPTS)" scripts/test.sh $(BUILD)

# The libFuzzer targets (tests/fuzz/), one after another, FUZZ_SECONDS each; FUZZ_TARGETS names
# some (proto json jobspec idx llmc tokens sensor), else all. make test runs each for 12 s.
FUZZ_SECONDS ?= 600
FUZZ_TARGETS ?=
fuzz: deps
	@tests/fuzz/fuzz.sh $(BUILD)-fuzz $(FUZZ_SECONDS) $(FUZZ_TARGETS)

demo: build
	@scripts/demo.sh $(BUILD)

# Every benchmark, short runs, each figure under a heading (bench/all.sh).
bench: build
	@bench/all.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-tsan $(BUILD)-fuzz
