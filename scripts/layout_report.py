"""The package's layout in figures (issue 51): modules per package, the largest files, import circles.

Run from a checkout's root: ``.venv/bin/python scripts/layout_report.py`` (add ``--root DIR`` to report another
checkout of the package, e.g. an older commit's worktree; it is imported from there). Deprecated aliases
(`pcr_rag._moved`) are not counted as modules. Circles are the strongly connected groups of the module import
graph (grimp, type-only imports included).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
from pathlib import Path


def _aliases(root: Path) -> set[str]:
    moved = root / "pcr_rag" / "_moved.py"
    if not moved.exists():
        return set()
    spec = importlib.util.spec_from_file_location("layout_moved", moved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(module.MOVED) | set(getattr(module, "SPLIT", {})) | {"pcr_rag.runtime"} - _packages_with_code(root)


def _packages_with_code(root: Path) -> set[str]:
    runtime = root / "pcr_rag" / "runtime"
    has_code = runtime.is_dir() and any("alias_module" not in p.read_text() for p in runtime.glob("[!_]*.py"))
    return {"pcr_rag.runtime"} if has_code else set()


def _cycles(graph, modules: list[str]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if not w.startswith("pcr_rag"):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for m in modules:
        if m not in index:
            visit(m)
    return groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd())
    args = parser.parse_args()
    root = args.root.resolve()
    sys.path.insert(0, str(root))
    import grimp

    graph = grimp.build_graph("pcr_rag", cache_dir=None)
    aliases = _aliases(root)
    modules = sorted(m for m in graph.modules if m.startswith("pcr_rag") and m not in aliases
                     and not any(m.startswith(a + ".") for a in aliases))
    per_package: collections.Counter[str] = collections.Counter()
    for m in modules:
        parts = m.split(".")
        if not (root.joinpath(*parts) / "__init__.py").exists():
            per_package[".".join(parts[:-1])] += 1
    print("modules per package (deprecated aliases not counted):")
    for package, count in sorted(per_package.items()):
        print(f"  {package}: {count}")
    sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(root).as_posix())
                    for p in (root / "pcr_rag").rglob("*.py")), reverse=True)[:8]
    print("largest files (lines):", ", ".join(f"{path} {n}" for n, path in sizes))
    groups = _cycles(graph, modules)
    print(f"import circles (strongly connected groups of modules): {len(groups)}")
    for group in groups:
        print("  " + " <-> ".join(group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
