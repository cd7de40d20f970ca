#!/usr/bin/env python3
"""The map of who uses whom inside daemon/ and train/ (issues 11 and 19), for a person to read
and for the check to fail on. Run as the `include_map` unit test (tests/meson.build), or by hand.

Includes: every `#include "x.h"` of the files of daemon/ and train/ (their subfolders too),
resolved to the project's file (the file's own folder, then the parts' folders), printed file
by file.

A part is x.c with x.h, together with x_int.h and the .c files without a header of their own
that include x_int.h: one part split into files that share its insides (daemon/server/: server.c
and the req_*.c files around server_int.h). A part without an _int.h is its own files only.

Calls, from the build tree given (BUILD_DIR, any meson tree of this project; its
compile_commands.json says which object is which source): each object's undefined symbols that
another object of the same folder defines (file y calls file x), printed part by part.

The checks, in daemon/ and in train/:
  - no include circle between files;
  - no circle between parts, by includes (daemon/) or by calls (both);
  - no circle of calls between files, except inside one part that shares an _int.h;
  - daemon/ reaches kernels/ only through train/: no daemon/ file includes a kernels/ header
    or calls a function a kernels/ object defines.
Exits 1 naming each circle (with the functions that make its calls) or arrow to kernels/ it
found, else 0.
  usage: scripts/include-map.py [BUILD_DIR]"""
import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ["daemon", "train"]  # the folders checked
DIRS = ["daemon", "daemon/server", "common", "proto", "store", "train", "kernels",
        "kernels/cuda"]  # where a bare include is looked for, after the source root (every
                         # include names its part: "train/sensor.h") and the file's folder
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def resolve(name, here):
    """The repository path of the header name included from directory here, or None."""
    for d in ["", here] + DIRS:
        p = os.path.join(d, name)
        if os.path.isfile(os.path.join(ROOT, p)):
            return os.path.normpath(p)
    return None


def sccs(graph):
    """The strongly connected components of graph with more than one node (Tarjan), each as
    a sorted list: every circle of the graph lies inside one of them."""
    index, low, stack, on, out = {}, {}, [], set(), []
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in nodes:
        if n not in index:
            visit(n)
    return out


def circle_in(graph, comp, start=None):
    """The shortest circle through start (the component's first node when None) inside the
    component, as a list that ends where it starts."""
    start, inside = start if start is not None else comp[0], set(comp)
    prev, todo = {start: None}, [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in inside and w not in prev:
                prev[w] = v
                todo.append(w)
    return comp + [start]


def circles_in(graph, comp):
    """The shortest circle through each node of a component, each circle once: together they
    name every node and, for two nodes that call each other, that pair."""
    found, seen = [], set()
    for n in comp:
        c = circle_in(graph, comp, n)
        i = c.index(min(c[:-1]))
        key = tuple(c[i:-1] + c[:i])  # the same circle from another start is the same circle
        if key not in seen:
            seen.add(key)
            found.append(c)
    return found


def stem(path):
    return os.path.splitext(os.path.basename(path))[0]


def find_parts(files):
    """Each file -> its part (the path of x without extension, x.c + x.h + x_int.h and the
    .c files without a header of their own that include x_int.h), and the parts that have an
    _int.h."""
    part, shared = {}, set()
    for f in files:
        base = os.path.splitext(f)[0]
        if base.endswith("_int"):
            base = base[: -len("_int")]
            shared.add(base)
        part[f] = base
    for f in files:
        if not f.endswith(".c") or os.path.exists(os.path.join(ROOT, f[:-2] + ".h")):
            continue
        with open(os.path.join(ROOT, f)) as fh:
            for n in INCLUDE.findall(fh.read()):
                t = resolve(n, os.path.dirname(f))
                if t is not None and t.endswith("_int.h") and t in part:
                    part[f] = part[t]
    return part, shared


def tree_files(tree):
    return sorted(glob.glob(f"{tree}/**/*.c", recursive=True) +
                  glob.glob(f"{tree}/**/*.h", recursive=True))


def include_checks(tree, files, part):
    """Prints the includes of tree's files; returns the include circles and kernels/ arrows."""
    graph, bad = {}, []
    print(f"includes ({tree}/ file -> the project's headers it includes):")
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
            if tree == "daemon" and t.startswith("kernels/"):
                bad.append(f"{f} includes {t}: an arrow from daemon/ to kernels/")
        graph[f] = {t for t in targets if t in part}
        print(f"  {f}: {' '.join(targets) if targets else '-'}")
    for comp in sccs(graph):
        for c in circles_in(graph, comp):
            bad.append("include circle between files: " + " -> ".join(c))
    if tree == "daemon":
        mods = {}
        for f, ts in graph.items():
            mods.setdefault(part[f], set()).update(part[t] for t in ts if part[t] != part[f])
        print(f"parts of {tree}/ (x.c + x.h, and the files sharing x_int.h -> the parts whose "
              "headers they include):")
        for m in sorted(mods):
            print(f"  {m}: {' '.join(sorted(mods[m])) or '-'}")
        for comp in sccs(mods):
            for c in circles_in(mods, comp):
                bad.append("circle between parts (includes): " + " -> ".join(c))
    return bad


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


def objects(build):
    """Source path (relative to the repository) -> its object file, from compile_commands.json.
    A source built into several targets counts once (its first object)."""
    out = {}
    with open(os.path.join(build, "compile_commands.json")) as fh:
        for e in json.load(fh):
            src = os.path.relpath(os.path.join(e["directory"], e["file"]), ROOT)
            obj = os.path.join(e["directory"], e["output"])
            if src not in out and obj.endswith(".o") and os.path.exists(obj):
                out[src] = obj
    return out


def why(needs, owner, a, b):
    """The functions of b that a calls, for a circle's message: at most two."""
    syms = sorted(s for s in needs[a] if owner.get(s) == b)
    return ", ".join(syms[:2]) + (", ..." if len(syms) > 2 else "")


def circle_text(c, needs, owner):
    return " -> ".join(
        c[i] + (f" ({why(needs, owner, c[i], c[i + 1])})" if i + 1 < len(c) else "")
        for i in range(len(c)))


def call_checks(tree, build, objs, part, shared, kernel_syms):
    """Prints which part of tree calls which; returns the circles and calls into kernels/."""
    mine = {s: o for s, o in objs.items() if s.startswith(tree + "/") and s.endswith(".c")}
    if not mine:
        return [f"no {tree}/ object files in {build} (build it first)"]
    owner, needs, bad = {}, {}, []
    for src, obj in sorted(mine.items()):
        d, u = symbols(obj)
        for s in d:
            owner.setdefault(s, src)
        needs[src] = u
    files = {src: {owner[s] for s in u if s in owner and owner[s] != src}
             for src, u in needs.items()}
    for src in sorted(needs):
        for s in sorted(needs[src] & kernel_syms if tree == "daemon" else ()):
            bad.append(f"{src} calls {s}, defined in kernels/: an arrow from daemon/ to kernels/")
    for comp in sccs(files):
        for c in circles_in(files, comp):
            ps = {part.get(f, f) for f in c}
            if len(ps) == 1 and ps <= shared:
                continue  # one part's files around its _int.h may call each other
            bad.append("circle of calls between files: " + circle_text(c, needs, owner))
    pneeds = {}
    for src, u in needs.items():
        pneeds.setdefault(part.get(src, src), set()).update(u)
    powner = {s: part.get(src, src) for s, src in owner.items()}
    parts = {}
    print(f"calls ({tree}/ part -> the {tree}/ parts whose functions it calls; {build}):")
    for p in sorted(pneeds):
        parts[p] = {powner[s] for s in pneeds[p] if s in powner and powner[s] != p}
        print(f"  {p}: {' '.join(sorted(parts[p])) or '-'}")
    several = {p for p in pneeds if sum(part.get(f, f) == p for f in needs) > 1}
    for comp in sccs(parts):
        for c in circles_in(parts, comp):
            if not several & set(c):
                continue  # parts of one .c each: the circle of files above has named it
            bad.append("circle between parts (calls): " + circle_text(c, pneeds, powner))
    return bad


def main():
    os.chdir(ROOT)
    build = sys.argv[1] if len(sys.argv) > 1 else None
    objs = objects(build) if build is not None else {}
    kernel_syms = set()
    for src, obj in objs.items():
        if src.startswith("kernels/"):
            kernel_syms |= symbols(obj)[0]
    bad = []
    for tree in TREES:
        files = tree_files(tree)
        part, shared = find_parts(files)
        bad += include_checks(tree, files, part)
        if build is not None:
            bad += call_checks(tree, build, objs, part, shared, kernel_syms)
    if bad:
        for b in bad:
            print("include-map: " + b, file=sys.stderr)
        return 1
    print("include-map: no circle inside daemon/ or train/, no arrow from daemon/ to kernels/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
