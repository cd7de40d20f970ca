# The two commands of the README. meson does the building; this file only makes sure the
# tools and libraries are there first and gives the steps names.
BUILD ?= build
MESON_OPTS ?= -Dwerror=true

.PHONY: all deps build test demo bench clean

all: build

deps:
	@scripts/deps.sh

build: deps
	@[ -f $(BUILD)/build.ninja ] || meson setup $(BUILD) $(MESON_OPTS)
	@ninja -C $(BUILD)

# Every suite, then the integration suite again against a thread-sanitizer build of traind.
test: build
	meson test -C $(BUILD) --print-errorlogs
	tests/tsan.sh $(BUILD)-tsan
	@scripts/test-summary.py $(BUILD) $(BUILD)-tsan

demo: build
	@scripts/demo.sh $(BUILD)

# Every benchmark, short runs, each figure under a heading (bench/all.sh).
bench: build
	@bench/all.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(BUILD)-tsan
