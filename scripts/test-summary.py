#!/usr/bin/env python3
"""Prints one closing line for the test runs meson logged: 'tests: N passed, N failed, N skipped'.

Reads each build directory's meson-logs/testlog.json (one JSON object per test run)."""
import json
import sys

passed = failed = skipped = 0
for build in sys.argv[1:]:
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
print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
