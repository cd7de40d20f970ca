#!/usr/bin/env python3
"""Prints the closing lines for the test runs meson logged.

The first is 'tests: N passed, N failed, N skipped', then '; failed stages: A, B' when a step of
scripts/test.sh failed (--failed-stage NAME, once per stage: a build, say, whose tests may never
have run). After it, one line per failed stage, and per build whose tests failed, naming the
test programs that failed there: '  plain suites (build): test_jobfiles, test_statedir'.

Each build is --build NAME DIR (the stage that ran DIR's tests), or a bare DIR (named by itself);
its results are DIR/meson-logs/testlog.json (one JSON object per test run), and a directory
without one adds nothing. Exits 1 when a test or a stage failed."""
import json
import sys

PASSED = ("OK", "EXPECTEDFAIL")


def program(name):
    """A meson test's program: 'traind:integration / test_statedir' is test_statedir."""
    return name.rsplit(" / ", 1)[-1]


def read_runs(build):
    """Every (program, result) in build's testlog.json, in the order they ran; [] without one."""
    runs = []
    try:
        with open(f"{build}/meson-logs/testlog.json") as f:
            for line in f:
                run = json.loads(line)
                runs.append((program(run.get("name", "?")), run.get("result")))
    except FileNotFoundError:
        pass
    return runs


def failed_programs(runs):
    """The programs of runs that failed, once each, with the result where it is not FAIL."""
    out = []
    for name, result in runs:
        if result in PASSED or result == "SKIP":
            continue
        what = name if result == "FAIL" else f"{name} ({result})"
        if what not in out:
            out.append(what)
    return out


def main(args):
    stages, builds = [], []
    while args:
        arg = args.pop(0)
        if arg == "--failed-stage" and args:
            stages.append(args.pop(0))
        elif arg == "--build" and len(args) >= 2:
            builds.append((args.pop(0), args.pop(0)))
        else:
            builds.append((arg, arg))

    passed = failed = skipped = 0
    details = []
    for name, build in builds:
        runs = read_runs(build)
        for _, result in runs:
            if result in PASSED:
                passed += 1
            elif result == "SKIP":
                skipped += 1
            else:
                failed += 1
        programs = failed_programs(runs)
        if programs:
            label = name if name == build else f"{name} ({build})"
            details.append((name, f"  {label}: {', '.join(programs)}"))

    line = f"tests: {passed} passed, {failed} failed, {skipped} skipped"
    if stages:
        line += f"; failed stages: {', '.join(stages)}"
    print(line)
    named = {name for name, _ in details}
    for stage in stages:
        if stage not in named:
            print(f"  {stage}: the stage failed, no test program in it did")
        for name, text in details:
            if name == stage:
                print(text)
    for name, text in details:
        if name not in stages:
            print(text)
    return 1 if failed or stages else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
