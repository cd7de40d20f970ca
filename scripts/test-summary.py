#!/usr/bin/env python3
"""Prints one closing line for the test runs meson logged: 'tests: N passed, N failed, N skipped'.

Reads each build directory's meson-logs/testlog.json (one JSON object per test run); a directory
without one adds nothing. Each --failed-stage NAME (a step of scripts/test.sh that failed, such
as a build, whose tests may never have run) is named after the counts. Exits 1 when a test or a
stage failed."""
import json
import sys

passed = failed = skipped = 0
stages = []
args = sys.argv[1:]
builds = []
while args:
    arg = args.pop(0)
    if arg == "--failed-stage" and args:
        stages.append(args.pop(0))
    else:
        builds.append(arg)

for build in builds:
    try:
        with open(f"{build}/meson-logs/testlog.json") as f:
            for line in f:
                result = json.loads(line).get("result")
                if result in ("OK", "EXPECTEDFAIL"):
                    passed += 1
                elif result == "SKIP":
                    skipped += 1
                else:
                    failed += 1
    except FileNotFoundError:
        pass
line = f"tests: {passed} passed, {failed} failed, {skipped} skipped"
if stages:
    line += f"; failed stages: {', '.join(stages)}"
print(line)
sys.exit(1 if failed or stages else 0)
