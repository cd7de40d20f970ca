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

test: build
	meson test -C $(BUILD) --print-errorlogs

demo: build
	@scripts/demo.sh $(BUILD)

bench: build
	@$(BUILD)/bench/bench_mlp

clean:
	rm -rf $(BUILD)
