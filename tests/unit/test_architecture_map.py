"""Every module under src/unbroken is findable from ARCHITECTURE.md (issue 24 item 9).

The folder map in ARCHITECTURE.md names each package and, under it, each module: by its
file name (``fs.py``) or by its bare name where a line lists several (``plan``, ``units``).
A module added without a line in the map fails here.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "unbroken"


def _folder_map() -> list[str]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text.split("## Folders", 1)[1].split("```", 2)[1]
    return block.splitlines()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _range_of(lines: list[str], lo: int, hi: int, folder: str) -> tuple[int, int] | None:
    """The lines under ``folder/`` (its own line, then the deeper-indented ones)."""
    for i in range(lo, hi):
        words = lines[i].split()
        if words and words[0] == folder + "/":
            end = i + 1
            while end < hi and (not lines[end].strip() or _indent(lines[end]) > _indent(lines[i])):
                end += 1
            return i, end
    return None


def findable(lines: list[str], rel: pathlib.PurePosixPath) -> bool:
    lo, hi = 0, len(lines)
    for folder in rel.parts[:-1]:
        found = _range_of(lines, lo, hi, folder)
        if found is None:
            return False
        lo, hi = found
    if rel.name == "__init__.py":
        return len(rel.parts) == 1 or lo < hi
    stem = rel.stem
    pattern = re.compile(rf"(?<![\w./]){re.escape(stem)}(\.py)?(?![\w/])")
    return any(pattern.search(line) for line in lines[lo:hi])


def test_every_module_is_in_the_folder_map() -> None:
    lines = _folder_map()
    modules = sorted(p.relative_to(PKG) for p in PKG.rglob("*.py"))
    assert len(modules) > 80  # the walk found the package
    missing = [str(m) for m in modules if not findable(lines, pathlib.PurePosixPath(m))]
    assert not missing, "modules ARCHITECTURE.md's folder map does not name:\n" + "\n".join(missing)


def test_the_rule_itself() -> None:
    lines = ["common/  x", "  fs.py  checksums", "  objstore/  the layer: base, options", "data/"]
    assert findable(lines, pathlib.PurePosixPath("common/fs.py"))
    assert findable(lines, pathlib.PurePosixPath("common/objstore/base.py"))
    assert not findable(lines, pathlib.PurePosixPath("common/objstore/_fsspec.py"))
    assert not findable(lines, pathlib.PurePosixPath("data/fs.py"))  # another folder's name
    assert not findable(lines, pathlib.PurePosixPath("elastic/fs.py"))


INVARIANT = re.compile(r"\b[CDTE]-[A-Z][A-Z0-9-]*[A-Z0-9]\b")


def test_every_invariant_the_code_cites_is_defined() -> None:
    """issue 24 item 9: an ID cited in the code (``C-ATOMIC``, ``D-ORDER``, ...) is a row of
    ARCHITECTURE.md's invariant table: the promise and the test that proves it."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text.split("## Invariants and the tests that prove them", 1)[1]
    defined = set(re.findall(r"^\| ([CDTE]-[A-Z0-9-]+) \|", table, flags=re.M))
    assert len(defined) > 15  # the table was found
    cited: dict[str, str] = {}
    for path in sorted([*PKG.rglob("*.py"), ROOT / "README.md", ROOT / "ARCHITECTURE.md"]):
        for name in INVARIANT.findall(path.read_text()):
            cited.setdefault(name, str(path.relative_to(ROOT)))
    undefined = {n: where for n, where in cited.items() if n not in defined}
    assert not undefined, f"invariants cited but not defined in ARCHITECTURE.md: {undefined}"


def test_every_test_the_docs_name_exists() -> None:
    """An invariant's proof is a test that runs: each ``tests/...py`` path (or glob) that
    ARCHITECTURE.md or README.md names matches a file, and each ``::test_name`` is defined
    in it (renames drift otherwise)."""
    text = (ROOT / "ARCHITECTURE.md").read_text() + (ROOT / "README.md").read_text()
    refs = re.findall(r"(tests/[\w/*.-]+\.py)(?:::(\w+))?", text)
    assert len(refs) > 20  # the references were found
    missing = []
    for path, name in refs:
        files = sorted(ROOT.glob(path))
        if not files:
            missing.append(path)
        elif name and not any(re.search(rf"def {name}\b", f.read_text()) for f in files):
            missing.append(f"{path}::{name}")
    assert not missing, f"ARCHITECTURE.md names tests that do not exist: {missing}"
