"""No import runs upward: the package's layers, read from the source (issue 15).

Every ``import`` in ``src/unbroken`` (function-local ones too: a lazy import is still an
arrow) is checked against the layer table below. A module may import its own group, or a
group on a lower layer of the same table; siblings on one layer (``data`` and ``ckpt``) never
import each other. Inside the packages of ``CYCLE_FREE`` no import cycle either, even
between modules of one group (issue 24 item 7). See ARCHITECTURE.md for what each layer is.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"

# Each table lists layers from the bottom up; a layer holds groups, a group is a tuple of
# package prefixes whose modules may import each other freely. Longest prefix wins.
Table = list[list[tuple[str, ...]]]

TOP: Table = [
    [("unbroken.common", "unbroken")],  # the root package: __version__ and lazy names only
    [("unbroken.data",), ("unbroken.ckpt",)],
    [("unbroken.elastic",)],
    [("unbroken.demo",)],
    [("unbroken.cli", "unbroken.__main__")],  # `python -m unbroken` is the CLI
]
INNER: dict[str, Table] = {
    "unbroken.data": [
        [("unbroken.data.manifest",)],
        [("unbroken.data.tar",)],
        [("unbroken.data.tokens",), ("unbroken.data.prepare",), ("unbroken.data.feed",)],
        [("unbroken.data.stream",)],
        [("unbroken.data.diagnose",)],
        [("unbroken.data",)],
    ],
    "unbroken.data.stream": [
        [("unbroken.data.stream.order",), ("unbroken.data.stream.transport",)],
        [("unbroken.data.stream.config",)],
        [("unbroken.data.stream.remote",)],
        [("unbroken.data.stream.readers",)],
        [("unbroken.data.stream.dataset",)],
        [("unbroken.data.stream.loader",)],
        [("unbroken.data.stream",)],
    ],
    "unbroken.data.stream.remote": [
        [
            ("unbroken.data.stream.remote.locks",),
            ("unbroken.data.stream.remote.pool",),
            ("unbroken.data.stream.remote.probe",),
            ("unbroken.data.stream.remote.fetch",),
        ],
        [("unbroken.data.stream.remote.index",)],
        [("unbroken.data.stream.remote.events",), ("unbroken.data.stream.remote.readers",)],
        [("unbroken.data.stream.remote.plan",)],
        [("unbroken.data.stream.remote.units",)],
        # the cache starts its fetcher process, which serves the cache
        [("unbroken.data.stream.remote.cache", "unbroken.data.stream.remote.fetcher")],
        [("unbroken.data.stream.remote",)],
    ],
    # format (what the bytes mean) < io (reading and writing them: local, then remote) <
    # policy (when to save, what to restore, tools over checkpoints)
    "unbroken.ckpt": [
        [
            (
                "unbroken.ckpt.bounds",
                "unbroken.ckpt.codec",
                "unbroken.ckpt.config",
                "unbroken.ckpt.dcp_metadata",
                "unbroken.ckpt.manifest",
                "unbroken.ckpt.rng",
                "unbroken.ckpt.say",
                "unbroken.ckpt.schema",
                "unbroken.ckpt.state",
                "unbroken.ckpt.stats",
            )
        ],
        [
            (
                "unbroken.ckpt.collectives",
                "unbroken.ckpt.load",
                "unbroken.ckpt.lock",
                "unbroken.ckpt.memplan",
                "unbroken.ckpt.memtier",
                "unbroken.ckpt.per_rank",
                "unbroken.ckpt.replica",
                "unbroken.ckpt.save",
                "unbroken.ckpt.snapshot",
                "unbroken.ckpt.store",
                "unbroken.ckpt.tensor_io",
                "unbroken.ckpt.verify",
            )
        ],
        [("unbroken.ckpt.archive",)],
        [("unbroken.ckpt.checkpointer", "unbroken.ckpt.export", "unbroken.ckpt.compare")],
        [("unbroken.ckpt",)],
    ],
    "unbroken.elastic": [
        [
            (
                "unbroken.elastic.faults",
                "unbroken.elastic.heartbeat",
                "unbroken.elastic.planner",
                "unbroken.elastic.preflight",
                "unbroken.elastic.recovery",
                "unbroken.elastic.rendezvous",
            )
        ],
        [("unbroken.elastic.launch",)],
        [("unbroken.elastic.supervisor",)],
        [("unbroken.elastic.drill",)],
        [("unbroken.elastic",)],
    ],
    # the drill: what to inject (plan) < doing it, judging it < printing it < the run
    "unbroken.elastic.drill": [
        [("unbroken.elastic.drill.plan",)],
        [("unbroken.elastic.drill.inject",), ("unbroken.elastic.drill.judge",)],
        [("unbroken.elastic.drill.report",), ("unbroken.elastic.drill.plot",)],
        [("unbroken.elastic.drill.runner",)],
        [("unbroken.elastic.drill",)],
    ],
}


def _place(table: Table, mod: str) -> tuple[int, int, str]:
    """(layer, group index, matched prefix) of ``mod``; the longest matching prefix wins."""
    best: tuple[int, int, str] | None = None
    for layer, groups in enumerate(table):
        for gi, group in enumerate(groups):
            for p in group:
                if (mod == p or mod.startswith(p + ".")) and (
                    best is None or len(p) > len(best[2])
                ):
                    best = (layer, gi, p)
    if best is None:
        raise LookupError(f"{mod} is in no layer of the table: add it")
    return best


def _allowed(table: Table, src: str, dst: str) -> bool:
    a, b = _place(table, src), _place(table, dst)
    return a[:2] == b[:2] or b[0] < a[0]


def arrow_ok(src: str, dst: str) -> bool:
    """May module ``src`` import ``dst``? (both ``unbroken...`` dotted names). Inside one
    group that has a table of its own, that table decides, and so on down."""
    table = TOP
    while _allowed(table, src, dst):
        here = _place(table, src)
        inner = INNER.get(here[2])
        if here != _place(table, dst) or inner is None or inner is table:
            return True
        table = inner
    return False


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_only(tree: ast.Module) -> set[int]:
    """The nodes under a module-level ``if TYPE_CHECKING:`` (never run)."""
    return {
        id(inner)
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    # the root package is every module's parent, so what it imports at run time must be
    # light; its type-only imports of the public names never run and are not arrows
    skip = _type_only(tree) if mod == "unbroken" else set()
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` imports the submodule: the arrow points at it
            for a in node.names:
                out.append(
                    (node.lineno, f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base)
                )
    return [(n, d) for n, d in out if d == "unbroken" or d.startswith("unbroken.")]


def _is_module(name: str) -> bool:
    p = SRC.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def test_no_import_runs_upward() -> None:
    files = sorted(SRC.joinpath("unbroken").rglob("*.py"))
    assert len(files) > 40  # the walk found the package
    bad = []
    for f in files:
        src = _module_name(f)
        for line, dst in _imports(f):
            if not arrow_ok(src, dst):
                bad.append(f"{f.relative_to(SRC)}:{line}: {src} imports {dst}")
    assert not bad, "imports that run upward or sideways:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        ("unbroken.ckpt.checkpointer", "unbroken.common.events", True),
        ("unbroken.ckpt.checkpointer", "unbroken.elastic.recovery", False),
        ("unbroken.elastic.drill.judge", "unbroken.demo", False),
        ("unbroken.data.stream.dataset", "unbroken.ckpt.store", False),
        ("unbroken.ckpt.store", "unbroken.data.manifest", False),
        ("unbroken.data.tar.reader", "unbroken.data.stream.order", False),
        ("unbroken.data.stream.loader", "unbroken.data.feed.prefetch", True),
        ("unbroken.data.stream.order", "unbroken.data.stream.dataset", False),
        ("unbroken.data.stream.readers", "unbroken.data.stream.remote.cache", True),
        ("unbroken.data.stream.remote.cache", "unbroken.data.stream.readers", False),
        ("unbroken.data.stream.remote.index", "unbroken.data.stream.remote.units", False),
        ("unbroken.data.stream.remote.fetcher", "unbroken.data.stream.remote.cache", True),
        ("unbroken.ckpt.store", "unbroken.ckpt.archive.remote", False),
        ("unbroken.ckpt.checkpointer", "unbroken.ckpt.archive.remote", True),
        ("unbroken.elastic.supervisor", "unbroken.elastic.drill.runner", False),
        ("unbroken.elastic.launch.attempt", "unbroken.elastic.supervisor", False),
        ("unbroken.elastic.rendezvous", "unbroken.elastic.launch.attempt", False),
        ("unbroken.elastic.supervisor", "unbroken.elastic.launch.standby", True),
        ("unbroken.elastic.drill.inject", "unbroken.elastic.drill.report", False),
        ("unbroken.elastic.drill.inject", "unbroken.elastic.drill.judge", False),
        ("unbroken.elastic.drill.plan", "unbroken.elastic.drill.judge", False),
        ("unbroken.elastic.drill.report", "unbroken.elastic.drill.judge", True),
        ("unbroken.elastic.drill.runner", "unbroken.elastic.drill.inject", True),
        ("unbroken.common.fs", "unbroken.data.manifest", False),
        ("unbroken.cli", "unbroken.demo", True),
        ("unbroken.ckpt.manifest", "unbroken.ckpt.per_rank", False),  # format -> io
        ("unbroken.ckpt.per_rank", "unbroken.ckpt.manifest", True),
        ("unbroken.ckpt.save", "unbroken.ckpt.checkpointer", False),  # io -> policy
        ("unbroken.ckpt.checkpointer", "unbroken.ckpt.load", True),
    ],
)
def test_the_rule_itself(src: str, dst: str, ok: bool) -> None:
    assert arrow_ok(src, dst) is ok


# --- no cycles: inside a package, modules import one way (issue 24 item 7) -------------------

CYCLE_FREE = ["unbroken.ckpt"]


def import_graph(prefix: str) -> dict[str, set[str]]:
    """module -> the modules under ``prefix`` it imports (function-local and TYPE_CHECKING
    imports too: each is an arrow a reader has to follow)."""
    graph: dict[str, set[str]] = {}
    for f in sorted(SRC.joinpath(*prefix.split(".")).rglob("*.py")):
        src = _module_name(f)
        graph[src] = {
            dst
            for _, dst in _imports(f)
            if (dst == prefix or dst.startswith(prefix + ".")) and dst != src
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", CYCLE_FREE)
def test_no_import_cycle(package: str) -> None:
    graph = import_graph(package)
    assert len(graph) > 10  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_rule_itself() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    # the manifest <-> per_rank cycle this check was written against (issue 24 item 7)
    old = {
        "unbroken.ckpt.manifest": {"unbroken.ckpt.per_rank"},
        "unbroken.ckpt.per_rank": {"unbroken.ckpt.manifest"},
    }
    assert find_cycle(old) == [
        "unbroken.ckpt.manifest",
        "unbroken.ckpt.per_rank",
        "unbroken.ckpt.manifest",
    ]


# --- lazy names: the type checker sees them (issue 24 item 10) --------------------------------


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
        ):
            return dict(ast.literal_eval(node.value))
    raise LookupError("no _LAZY table")


def _type_checking_imports(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module:
                    out.update({a.asname or a.name: imp.module for a in imp.names})
    return out


@pytest.mark.parametrize("package", ["unbroken", "unbroken.data", "unbroken.elastic"])
def test_every_lazy_name_is_imported_for_the_type_checker(package: str) -> None:
    """issue 24 item 10: a name a package resolves lazily (``__getattr__``) is also imported
    under ``if TYPE_CHECKING:`` from the module it resolves to, or mypy types it ``object``
    in every caller (``from unbroken import Checkpointer``). The root package's type-only
    imports never run, so the layer rule does not count them (``_type_only``)."""
    path = SRC.joinpath(*package.split("."), "__init__.py")
    tree = ast.parse(path.read_text(), str(path))
    lazy = _lazy_table(tree)
    assert lazy  # the walk found the table
    assert _type_checking_imports(tree) == lazy
    assert set(lazy) <= set(importlib.import_module(package).__all__)


def test_the_launch_modules_run_with_dash_m_load_only_when_run() -> None:
    """``unbroken run`` starts ``python -m unbroken.elastic.launch.standby`` (and ``.agent``):
    runpy imports the parent packages first, and one that imported the module itself made
    runpy warn on every attempt ("found in sys.modules ... unpredictable behaviour")."""
    import subprocess
    import sys

    code = "import sys, unbroken.elastic.launch; print(sorted(m for m in sys.modules if m.startswith('unbroken.elastic.launch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    ran = subprocess.run(
        [sys.executable, "-W", "always", "-m", "unbroken.elastic.launch.standby"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    assert "found in sys.modules" not in ran.stderr, ran.stderr
