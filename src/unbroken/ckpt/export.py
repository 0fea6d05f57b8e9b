"""What ``unbroken ckpt ls|inspect|verify|export`` print and write (the CLI only calls these).

* :func:`format_listing`: one row per step with size, age and where it lives (local,
  remote, both), plus quarantined, uncommitted and in-progress directories.
* :func:`format_manifest`: a manifest in human form.
* :func:`verify_steps` / :func:`verify_report`: restore()'s own verification of each step
  directory (never modifies anything), so its verdict always agrees with restore().
* :func:`export_safetensors`: consolidated weights of one component for inference users,
  keys as the model's own ``state_dict`` names (``0.weight``).

Every command reads the manifest through the one validated
:class:`~unbroken.ckpt.manifest.CheckpointManifest`, and everything it prints that came
from a file (manifest strings, directory names, error details) goes through
:func:`~unbroken.common.text.printable`: a checkpoint cannot move the cursor, clear the
screen or start a line of its own (issue 20).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import time
from dataclasses import dataclass

import torch

from unbroken.ckpt.manifest import (
    COMPONENTS,
    MANIFEST,
    CheckpointManifest,
    component_of,
    component_prefix,
    split_key,
)
from unbroken.ckpt.store import CorruptCheckpoint, Store
from unbroken.common.errors import CheckFailed
from unbroken.common.fs import fsync_dir, is_remote, temp_sibling
from unbroken.common.progress import Progress, progress_bar
from unbroken.common.tables import render_table
from unbroken.common.text import printable

__all__ = [
    "StepVerdict",
    "export_safetensors",
    "format_listing",
    "format_manifest",
    "verify_report",
    "verify_steps",
]


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")  # pragma: no cover


def _age(t: float | None, now: float) -> str:
    if t is None:
        return "?"
    s = max(0.0, now - t)
    for unit, sec in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= sec:
            return f"{s / sec:.0f}{unit} ago"
    return f"{s:.0f}s ago"


_IN = "    "  # the tables inside `ckpt inspect` sit under its two-space-indented fields


def _manifest(store: Store, step: int) -> CheckpointManifest:
    try:
        return store.read_manifest(step)
    except CorruptCheckpoint as e:
        raise ValueError(f"cannot read the manifest of step {step} in {store.root!r}: {e}") from e


def _require_root(root: str) -> None:
    """Refuse a root that is not a directory, saying which way it is not."""
    if os.path.isdir(root):
        return
    if os.path.lexists(root):
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"{root!r} is a file, not a checkpoint directory; pass the directory the "
            "Checkpointer saves into (the one holding step-NNNNNNNN/)",
        )
    raise FileNotFoundError(f"checkpoint directory {root!r} does not exist")


def _pick_step(store: Store, step: int | None) -> int:
    _require_root(store.root)
    steps = store.steps()
    if not steps:
        raise CheckFailed(
            f"{store.root!r} holds no committed checkpoint (no step-N/{MANIFEST}); "
            "is this a checkpoint root?"
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ValueError(
            f"no committed checkpoint for step {step} in {store.root!r}; committed steps: {steps}"
        )
    return step


# --- ls ------------------------------------------------------------------------------------


def format_listing(directory: str, *, archive: str | None = None) -> str:
    """Table of committed steps: step, size, age, status (local / remote / local+remote).

    ``directory`` may itself be a remote URL (then only the archive is listed).
    """
    from unbroken.ckpt.archive.remote import Archive

    now = time.time()
    local: dict[int, tuple[int, float]] = {}
    notes: list[str] = []
    if is_remote(directory):
        archive, store = archive or directory, None
    else:
        store = Store(directory)
        _require_root(store.root)
        for s in store.steps():
            info = store.info(s)
            local[s] = (info.size, info.mtime)
        notes += [f"{n}: quarantined step {s} ({why})" for n, s, why in store.quarantined()]
        notes += [
            f"{n}: DAMAGED, no {MANIFEST} (restore() moves it aside; see `ckpt verify`)"
            for n in store.uncommitted()
        ]
        notes += [f"{n}: save in progress, or debris of a killed one" for n in store.temp_dirs()]
        notes = [printable(n) for n in notes]
    remote: dict[int, tuple[int, float | None]] = {}
    if archive is not None:
        arch = Archive(archive)
        if arch.local_root is not None and not os.path.isdir(arch.local_root):
            raise FileNotFoundError(f"archive directory {arch.local_root!r} does not exist")
        for s in arch.steps():
            try:
                rinfo = arch.info(s)
            except RuntimeError as e:
                notes.append(printable(f"remote step {s}: unreadable manifest ({e})"))
                continue
            remote[s] = (rinfo.size, rinfo.created)
    rows = []
    for s in sorted(set(local) | set(remote)):
        size, when = local[s] if s in local else remote[s]
        where = "+".join(w for w, d in (("local", local), ("remote", remote)) if s in d)
        rows.append([str(s), _size(size), _age(when, now), where])
    where = store.root if store is not None else ""
    if archive is not None:
        where = f"{where} (archive {archive})" if where else f"archive {archive}"
    out = [f"checkpoints in {printable(where)}"]
    out.append(
        render_table(rows, header=["STEP", "SIZE", "AGE", "STATUS"], right={0, 1})
        if rows
        else "(no committed checkpoint)"
    )
    if store is not None:
        summary = f"{len(local)} local"
        if archive is not None:
            summary += f", {len(remote)} remote"
        out.append(summary)
    out += notes
    return "\n".join(out)


# --- inspect -------------------------------------------------------------------------------


def format_manifest(directory: str, step: int | None = None, *, top: int = 10) -> str:
    """The manifest of ``step`` (default: newest) in human form."""
    store = Store(directory)
    step = _pick_step(store, step)
    m = _manifest(store, step)
    when = (
        datetime.datetime.fromtimestamp(m.created).isoformat(sep=" ", timespec="seconds")
        + f" ({_age(m.created, time.time())})"
        if m.created is not None
        else "?"
    )
    p = printable
    out = [
        f"checkpoint {p(store.step_dir(step))}",
        f"  step            {m.step}",
        f"  created         {when}",
        f"  format          unbroken-checkpoint v{m.version}, checksums xxh3_128",
        f"  versions        unbroken {p(m.unbroken_version)}, torch {p(m.torch_version)}",
        f"  world size      {m.world_size}",
    ]
    for name, secs in (("save seconds", m.save_seconds), ("blocked seconds", m.blocked_seconds)):
        if secs is not None:
            out.append(f"  {name:<15} {secs} s")
    out.append(
        "  counters        " + (p(", ".join(f"{k}={v}" for k, v in m.counters.items())) or "-")
    )
    data = m.data_state
    text = json.dumps(data, sort_keys=True) if data is not None else "- (no JSON-able loader state)"
    out.append("  data state      " + p(text if len(text) <= 200 else text[:197] + "..."))
    out.append(f"  files           {len(m.files)} + {MANIFEST}, {_size(m.total_bytes)}")
    rows = [[p(n), _size(f.size), f.checksum] for n, f in sorted(m.files.items())]
    out.append(render_table(rows, header=["FILE", "SIZE", "CHECKSUM"], right={1}, indent=_IN))
    by_comp: dict[str, list[int]] = {}
    for k, t in m.tensors.items():
        c = by_comp.setdefault(component_of(k), [0, 0])
        c[0] += 1
        c[1] += t.nbytes
    total = sum(b for _, b in by_comp.values())
    out.append(f"  tensors         {len(m.tensors)}, {_size(total)}")
    comps = m.extra.get("components")
    differ = sorted(
        n for n, c in (comps if isinstance(comps, dict) else {}).items()
        if isinstance(c, dict) and c.get("differs")
    )  # fmt: skip
    if differ:
        out.append(f"  saved per rank  {p(', '.join(differ))} (differed between the ranks)")
    rows = [[p(c), str(n), _size(b)] for c, (n, b) in sorted(by_comp.items())]
    out.append(
        render_table(rows, header=["COMPONENT", "TENSORS", "BYTES"], right={1, 2}, indent=_IN)
    )
    biggest = sorted(m.tensors.items(), key=lambda kv: -kv[1].nbytes)[:top]
    if biggest:
        out.append(f"  largest tensors (top {len(biggest)})")
        rows = [
            [p(k), "x".join(map(str, t.shape)) or "()", t.dtype, _size(t.nbytes)]
            for k, t in biggest
        ]
        out.append(
            render_table(rows, header=["KEY", "SHAPE", "DTYPE", "BYTES"], right={3}, indent=_IN)
        )
    return "\n".join(out)


# --- verify --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepVerdict:
    """What restore()'s verification says about one step directory."""

    step: int
    ok: bool
    reason: str
    """quarantine slug (``checksum``, ``no-manifest`` ...); empty when ok."""
    detail: str
    size: int
    seconds: float


def _dir_size(path: str) -> int:
    try:
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(path))
    except OSError:
        return 0


def verify_steps(
    directory: str, step: int | None = None, *, progress: bool = True, deep: bool = False
) -> list[StepVerdict]:
    """Run restore()'s verification and decoding (``load_verified``, without a model) on
    ``step`` or on every ``step-N`` directory, committed or not (a directory without a
    manifest is damage to restore() too), with every rank's state file checked as the ranks
    of a same-size restore check them between them; ``deep``: every tensor's statistics
    recomputed too (see :func:`~unbroken.ckpt.verify.load_verified`). Read-only: nothing is
    quarantined."""
    from unbroken.ckpt.verify import load_verified

    store = Store(directory)
    _require_root(store.root)
    steps = store.candidates()
    if step is not None:
        if step not in steps:
            raise ValueError(
                f"no checkpoint directory for step {step} in {store.root!r}; steps: {steps}"
            )
        steps = [step]
    out = []
    sizes = {s: _dir_size(store.step_dir(s)) for s in steps}
    with progress_bar("verify", total=sum(sizes.values()), enabled=progress) as bar:
        for s in steps:
            t0 = time.perf_counter()
            try:
                v = load_verified(store, s, every_rank=True, deep=deep)
                del v  # drop the read-only mappings at once
                reason = detail = ""
            except CorruptCheckpoint as e:
                reason, detail = e.reason, e.detail
            out.append(
                StepVerdict(s, not reason, reason, detail, sizes[s], time.perf_counter() - t0)
            )
            bar.update(sizes[s])
    return out


def verify_report(
    directory: str, step: int | None = None, *, progress: bool = True, deep: bool = False
) -> tuple[bool, str]:
    """:func:`verify_steps` as a table. Returns ``(all ok, text)``; raises
    :class:`~unbroken.common.errors.CheckFailed` when there is no step directory at all."""
    verdicts = verify_steps(directory, step, progress=progress, deep=deep)
    root = Store(directory).root
    if not verdicts:
        raise CheckFailed(f"{root}: no committed checkpoint to verify (no step-N directory)")
    rows = [
        [
            str(v.step),
            "ok" if v.ok else f"DAMAGED ({v.reason})",
            _size(v.size),
            f"{v.seconds:.2f} s",
            printable(v.detail),
        ]
        for v in verdicts
    ]
    bad = sum(not v.ok for v in verdicts)
    table = render_table(rows, header=["STEP", "RESULT", "SIZE", "TIME", "DETAIL"], right={0, 2, 3})
    out = [f"verifying {printable(root)}", table]
    out.append(
        f"{len(verdicts)} checkpoint(s) verified, all intact"
        if not bad
        else f"{bad} of {len(verdicts)} checkpoint(s) DAMAGED; Checkpointer.restore() would "
        "move them aside (or skip them) and use the newest intact one"
    )
    return not bad, "\n".join(out)


# --- export --------------------------------------------------------------------------------


def _export_name(rest: str) -> str:
    """``a/b%2Fc`` (the codec's nested path) -> ``a.b/c``; flat state_dict keys pass as is."""
    return ".".join(p.replace("%2F", "/") for p in rest.split("/"))


def export_safetensors(
    directory: str,
    out: str,
    *,
    step: int | None = None,
    component: str = "model",
    progress: bool = True,
) -> str:
    """Write ``component``'s tensors of a verified checkpoint to ``out`` (safetensors),
    consolidated from any number of shards, keyed by the component's own state-dict names.

    An EMA saved as ``torch.optim.swa_utils.AveragedModel`` is exported as the averaged
    model's weights (``module.`` stripped, ``n_averaged`` dropped) so it loads into the base
    model. Returns a one-line summary. ``progress``: a bar over the three phases (verify the
    whole step, read the component, write the file) on a terminal.
    """
    try:
        import safetensors.torch  # noqa: F401 - fail before any work, with the fix
    except ImportError as e:
        raise RuntimeError("exporting needs safetensors: pip install 'unbroken[export]'") from e

    store = Store(directory)
    step = _pick_step(store, step)
    with progress_bar("export", total=3, unit="phase", enabled=progress) as bar:
        return _export(store, step, out, component, bar)


def _export(store: Store, step: int, out: str, component: str, bar: Progress) -> str:
    from safetensors.torch import save_file

    from unbroken.ckpt.tensor_io import fill
    from unbroken.ckpt.verify import load_verified

    bar.set_postfix_str("verifying")
    try:
        v = load_verified(store, step)
    except CorruptCheckpoint as e:
        raise RuntimeError(
            f"checkpoint step {step} in {store.root!r} failed verification ({e}); export "
            "another step with --step (see `unbroken ckpt verify`)"
        ) from e
    meta = v.manifest.tensors
    prefix = component_prefix(component)
    # a tensor that differed between ranks is saved per rank: export rank 0's copy
    saved = {split_key(k)[1]: k for k in sorted(meta) if split_key(k)[0] in (None, 0)}
    keys = sorted(k for k in saved if k.startswith(prefix))
    if not keys:
        have = sorted({component_of(k) for k in saved if k.startswith(COMPONENTS)})
        raise ValueError(
            f"checkpoint step {step} has no tensors for component {component!r}; "
            f"components with tensors: {have}. Pass --component with one of them"
        )
    bar.update()
    bar.set_postfix_str(f"reading {component}")
    whole = {k: torch.empty(meta[saved[k]].shape, dtype=meta[saved[k]].torch_dtype) for k in keys}
    # any number of shards; rank 0's copy of what was saved per rank
    fill(store.step_dir(step), v.manifest, {saved[k]: t for k, t in whole.items()}, views=v.tensors)
    tensors = {_export_name(k[len(prefix) :]): t for k, t in whole.items()}
    del v
    rest = [k for k in tensors if k != "n_averaged"]
    if "n_averaged" in tensors and rest and all(k.startswith("module.") for k in rest):
        tensors = {k.removeprefix("module."): tensors[k] for k in rest}
    bar.update()
    bar.set_postfix_str(f"writing {os.path.basename(out)}")
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = temp_sibling(out)
    try:
        save_file(
            tensors,
            tmp,
            metadata={"format": "pt", "unbroken_step": str(step), "component": component},
        )
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(out))
    bar.update()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return (
        f"exported {len(tensors)} tensors ({_size(total)}) of component {component!r} "
        f"from step {step} to {out}"
    )
