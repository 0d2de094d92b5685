#!/usr/bin/env python3
"""Fails when the top-level modules of a crate import each other in a cycle.

For each crate (a directory holding src/lib.rs or src/main.rs), every top-level module
(`crate::<name>`, a file `src/<name>.rs` or a folder `src/<name>/`) is a node; a path
`crate::<other>` (or `super::<other>` in a top-level file) in a module's non-test code is
an arrow to `<other>`. Any strongly connected set of two or more modules is printed with
the places that close it, and the exit status is 1. Test code (`#[cfg(test)]` modules,
files named tests.rs or under a tests/ folder) is left out: tests may reach anywhere.

Usage: module-cycles.py CRATE_DIR...
"""
import os
import re
import sys

COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\])*"')
CRATE_PATH = re.compile(r"\bcrate::(\{[^}]*\}|\w+)")
SUPER_PATH = re.compile(r"\bsuper::(\{[^}]*\}|\w+)")
TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+(\w+)\s*([;{])")


def strip_tests(text):
    """The text without `#[cfg(test)] mod x { ... }` blocks."""
    out, pos = [], 0
    for m in TEST_MOD.finditer(text):
        if m.start() < pos:
            continue
        out.append(text[pos:m.start()])
        if m.group(4) == ";":
            pos = m.end()
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        pos = i
    out.append(text[pos:])
    return "".join(out)


def test_only_modules(root_text):
    return {m.group(3) for m in TEST_MOD.finditer(root_text)}


def targets(group):
    """`a` or `{a, b::c, d as e}` -> the first segment of each path."""
    if not group.startswith("{"):
        return [group]
    inner, names, depth, cur = group[1:-1], [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            names.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    names.append(cur)
    return [re.split(r"\W", n.strip())[0] for n in names if n.strip()]


def crate_graph(crate):
    src = os.path.join(crate, "src")
    root = next(os.path.join(src, f) for f in ("lib.rs", "main.rs") if os.path.exists(os.path.join(src, f)))
    root_text = COMMENT.sub("", open(root).read())
    skip = test_only_modules(root_text)
    modules = set(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*[;{]", root_text, re.M)) - skip
    edges = {}
    for dirpath, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in ("tests", "bin")]
        for f in files:
            if not f.endswith(".rs") or f == "tests.rs":
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, src)
            top = rel.split(os.sep)[0].removesuffix(".rs")
            if top not in modules:
                continue
            text = strip_tests(STRING.sub('""', COMMENT.sub("", open(path).read())))
            found = [(g, CRATE_PATH) for g in CRATE_PATH.findall(text)]
            if os.sep not in rel:  # a top-level file: `super::` is the crate root
                found += [(g, SUPER_PATH) for g in SUPER_PATH.findall(text)]
            for group, _ in found:
                for t in targets(group):
                    if t in modules and t != top:
                        edges.setdefault(top, {}).setdefault(t, set()).add(rel)
    return modules, edges


def cycles(modules, edges):
    """Tarjan's strongly connected components of two or more modules."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
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

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return out


def main(crates):
    failed = False
    for crate in crates:
        modules, edges = crate_graph(crate)
        for comp in cycles(modules, edges):
            failed = True
            print(f"{crate}: import cycle between modules {', '.join(comp)}:")
            for a in comp:
                for b, files in sorted(edges.get(a, {}).items()):
                    if b in comp:
                        print(f"  {a} -> {b}  ({', '.join(sorted(files))})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["."]))
