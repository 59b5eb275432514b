"""The project's structure, held by tests (read from the source, no imports run):

- no import cycle between the project's modules, counting imports inside functions;
- an import inside a function says why, in a comment on its line or the line above;
- replay uses the rank only through the seam (watcher/runtime/seam.py): it
  never assigns an attribute of the rank, reads only what `Rank` declares, and
  imports only the runtime's leaf modules, none of their private names;
- the run directory's file names, and the stop exit code, are spelled only in
  watcher/rundir.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"watcher": ROOT / "watcher", "watcher.bpf": ROOT / "bpf", "watcher.uprobes": ROOT / "uprobes",
            "watcher.replay": ROOT / "replay", "watcher.analysis": ROOT / "analysis"}
# Modules replay may import from the runtime: they hold no rank state.
RUNTIME_LEAVES = {"checksum", "collectives", "control", "crashsite", "native", "samples", "seam", "supervisor",
                  "training", "window", "wordsum"}
# Fragments of the run directory's file names (watcher/rundir.py owns them).
RUN_DIR_NAMES = ("steps.jsonl", "replayed.rank", "result.pt", "arrive.rank", "merged.rank", "plan.json",
                 "crash_replay", "quarantine.json", "outcome.json", "recovery.json", "done.json", "from-copy",
                 "rediagnosis-", "incident.", ".skipped", "run.json")
RUN_DIR_PARTS = {"runtime", "incidents", "retained", "recording.duckdb", "control", "diagnosis", "affinity",
                 "orders", "exchange"}


def modules() -> dict[str, Path]:
    found = {}
    for pkg, top in PACKAGES.items():
        for path in top.rglob("*.py"):
            rel = path.relative_to(top).with_suffix("")
            if "site" in rel.parts or (pkg == "watcher" and rel.parts[0] in ("bpf", "uprobes", "replay", "analysis")):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([pkg] + parts)] = path
    return found


MODULES = modules()


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _imports(name: str, path: Path):
    """(imported module, node, inside a function) for every project import of a module."""
    tree = ast.parse(path.read_text())
    pkg = _package_of(name, path)
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nested = {id(n) for f in funcs for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                targets.append(sub if sub in MODULES else mod)
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            if t in MODULES:
                yield t, node, id(node) in nested


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in _imports(m, p)} - {m} for m, p in MODULES.items()}
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_inside_functions_say_why():
    """On the import's line or the line above; or once for the module, in a
    comment line starting "# Imports inside functions:"."""
    unexplained = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        if any(line.startswith("# Imports inside functions:") for line in lines):
            continue
        for _, node, inside in _imports(name, path):
            if inside:
                here, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ""
                if "#" not in here and not above.strip().startswith("#"):
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {here.strip()}")
    assert not unexplained, "imports inside functions with no reason given:\n" + "\n".join(sorted(set(unexplained)))


def _seam() -> set[str]:
    tree = ast.parse((ROOT / "watcher" / "runtime" / "seam.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Rank")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} | \
           {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def _is_rank(node) -> bool:
    """`rt` or `self.rt`: the rank as replay holds it."""
    return (isinstance(node, ast.Name) and node.id == "rt") or \
           (isinstance(node, ast.Attribute) and node.attr == "rt" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def test_replay_uses_the_rank_only_through_the_seam():
    allowed = _seam()
    assert {"rank", "world", "rundir", "flush", "enter_replay", "restore_counters"} <= allowed
    problems = []
    for name, path in MODULES.items():
        if not name.startswith(("watcher.replay", "watcher.analysis")):
            continue
        tree = ast.parse(path.read_text())
        where = lambda n: f"{path.relative_to(ROOT)}:{n.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_rank(node.value):
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    problems.append(f"{where(node)}: assigns rt.{node.attr}")
                elif node.attr not in allowed:
                    problems.append(f"{where(node)}: reads rt.{node.attr}, which the seam does not offer")
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute) and _is_rank(node.target.value):
                problems.append(f"{where(node)}: assigns rt.{node.target.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
                    and node.args and _is_rank(node.args[0])):
                attr = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
                if node.func.id == "setattr" or attr not in allowed:
                    problems.append(f"{where(node)}: {node.func.id}(rt, {attr!r})")
        for target, node, _ in _imports(name, path):
            if target.startswith("watcher.runtime."):
                leaf = target.split(".")[2]
                if leaf not in RUNTIME_LEAVES:
                    problems.append(f"{where(node)}: imports {target}, which holds rank state")
                if isinstance(node, ast.ImportFrom):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    if private:
                        problems.append(f"{where(node)}: imports private {private} from {target}")
    assert not problems, "\n".join(problems)


def _docstrings(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_run_directory_names_and_the_stop_code_live_in_rundir():
    problems = []
    for name, path in MODULES.items():
        if name in ("watcher.rundir", "watcher.syscall_names"):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        where = lambda n: f"{path.relative_to(ROOT)}:{n.lineno}"  # noqa: E731
        messages = set()  # text printed or raised: words for people, not paths
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "print"
                                               or getattr(node.func, "id", "").endswith("Error")
                                               or getattr(node.func, "attr", None) == "write"):
                messages |= {id(n) for a in node.args for n in ast.walk(a)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == 75 and type(node.value) is int:
                problems.append(f"{where(node)}: the stop exit code spelled out (rundir.STOP_EXIT_CODE)")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                    and node.right.value in RUN_DIR_PARTS:
                problems.append(f"{where(node)}: builds a run-directory path by hand (/ {node.right.value!r})")
            # A file name has no spaces: strings with them are words for people.
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and id(node) not in messages and not any(c.isspace() for c in node.value) \
                    and any(f in node.value for f in RUN_DIR_NAMES):
                problems.append(f"{where(node)}: a run-directory file name outside rundir.py: {node.value!r}")
    assert not problems, "\n".join(problems)
