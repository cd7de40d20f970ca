#!/usr/bin/env python3
"""The map of who uses whom inside daemon/ (issue 11, "Done when"), for a person to read and for
the check to fail on. Run by hand; nothing calls it.

Includes: every `#include "x.h"` of daemon/*.c and daemon/*.h, resolved to the project's file
(daemon/, common/, proto/, store/, train/, kernels/), printed file by file. A part is x.c with
x.h, together with x_int.h and the .c files without a header of their own that include it (the
server: server.c, stream.c, listing.c, history.c around server_int.h). Then two checks:
  - no circle inside daemon/: neither between files (x.c or x.h includes y.h) nor between
    parts (x uses y when one of x's files includes one of y's headers);
  - no arrow from daemon/ to kernels/: no daemon/ file includes a kernels/ header.
Calls, with a build tree given (BUILD_DIR, any meson tree of this project): each daemon/ object
file's undefined symbols that another daemon/ object defines (part x calls part y: printed,
and checked for circles like the includes), and any that a kernels/ object defines (must be
none: daemon/ reaches the kernels only through train/).
Exits 1 naming each circle or arrow to kernels/ it found, else 0.
  usage: scripts/include-map.py [BUILD_DIR]"""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ["daemon", "common", "proto", "store", "train", "kernels", "kernels/cuda"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def resolve(name, here):
    """The repository path of the header name included from directory here, or None."""
    for d in [here] + DIRS:
        p = os.path.join(d, name)
        if os.path.isfile(os.path.join(ROOT, p)):
            return os.path.normpath(p)
    return None


def circles(graph):
    """Every elementary circle found by depth-first search, each once (as a list of nodes)."""
    found, seen_keys = [], set()
    state = {}

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cyc = path[path.index(nxt):]
                key = frozenset(cyc)
                if key not in seen_keys:
                    seen_keys.add(key)
                    found.append(cyc + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    return found


PARTS = {}  # file name stem -> the part it belongs to, when not its own (see part_of)


def module(path):
    """The part a daemon/ file belongs to: x.c and x.h are part x; x_int.h, and a .c with no
    header of its own that includes x_int.h (server.c's stream.c, listing.c, history.c), are
    part x too: one part split into files that share its insides."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem.endswith("_int"):
        return stem[: -len("_int")]
    return PARTS.get(stem, stem)


def find_parts(files):
    for f in files:
        stem = os.path.splitext(os.path.basename(f))[0]
        if not f.endswith(".c") or os.path.exists(f[:-2] + ".h"):
            continue
        with open(f) as fh:
            for n in INCLUDE.findall(fh.read()):
                if n.endswith("_int.h"):
                    PARTS[stem] = n[: -len("_int.h")]


def main():
    os.chdir(ROOT)
    files = sorted(glob.glob("daemon/*.c") + glob.glob("daemon/*.h"))
    find_parts(files)
    graph, bad = {}, []
    print("includes (daemon/ file -> the project's headers it includes):")
    for f in files:
        with open(f) as fh:
            names = INCLUDE.findall(fh.read())
        targets = []
        for n in names:
            t = resolve(n, os.path.dirname(f))
            if t is None:
                targets.append(n + " (not found)")
                continue
            targets.append(t)
            if t.startswith("kernels/"):
                bad.append(f"{f} includes {t}: an arrow from daemon/ to kernels/")
        graph[f] = {t for t in targets if t.startswith("daemon/")}
        print(f"  {f}: {' '.join(targets) if targets else '-'}")

    for c in circles(graph):
        bad.append("include circle: " + " -> ".join(c))
    mods = {}
    for f, ts in graph.items():
        for t in ts:
            if module(t) != module(f):
                mods.setdefault(module(f), set()).add(module(t))
    print("parts (daemon/x.c + x.h, and the files sharing x_int.h -> the parts whose headers "
          "they include):")
    for m in sorted({module(f) for f in files}):
        print(f"  {m}: {' '.join(sorted(mods.get(m, ()))) or '-'}")
    for c in circles(mods):
        bad.append("circle between parts (includes): " + " -> ".join(c))

    if len(sys.argv) > 1:
        bad += calls(sys.argv[1])
    if bad:
        for b in bad:
            print("include-map: " + b, file=sys.stderr)
        return 1
    print("include-map: no circle inside daemon/, no arrow from daemon/ to kernels/")
    return 0


def symbols(obj):
    """(defined, undefined) global symbol names of an object file."""
    out = subprocess.run(["nm", "-g", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRVWC":
            defined.add(parts[2])
    return defined, undefined


def calls(build):
    """Prints which daemon/ module calls which; returns the circles and kernels/ calls."""
    objs = glob.glob(f"{build}/daemon/**/*.c.o", recursive=True)
    kobjs = glob.glob(f"{build}/kernels/**/*.o", recursive=True)
    if not objs:
        return [f"no daemon/ object files under {build}/daemon (build it first)"]
    owner, needs = {}, {}
    for o in objs:
        m = module(os.path.basename(o)[: -len(".o")])
        d, u = symbols(o)
        for s in d:
            owner[s] = m
        needs.setdefault(m, set()).update(u)
    kernel_syms = set()
    for o in kobjs:
        kernel_syms |= symbols(o)[0]
    graph, bad = {}, []
    print(f"calls (daemon/ part -> the daemon/ parts whose functions it calls; {build}):")
    for m in sorted(needs):
        graph[m] = {owner[s] for s in needs[m] if s in owner and owner[s] != m}
        print(f"  {m}: {' '.join(sorted(graph[m])) or '-'}")
        for s in sorted(needs[m] & kernel_syms):
            bad.append(f"daemon/ part {m} calls {s}, defined in kernels/: an arrow to kernels/")
    for c in circles(graph):
        bad.append("circle between parts (calls): " + " -> ".join(c))
    return bad


if __name__ == "__main__":
    sys.exit(main())
