"""The memory tier's peer replica: each rank's newest slot kept on the next node, so a node
loss loses <= K steps too (issue 25 peer replica; C-TIERS; design in ARCHITECTURE.md, "The
memory tier").

Placement is a ring by ``jump`` (the ranks per node: ``$LOCAL_WORLD_SIZE``, or
``$UNBROKEN_MEMORY_JUMP``): rank ``r`` sends to ``(r + jump) % W`` and keeps the copy of rank
``(r - jump) % W`` as ``<memory dir>/replica-of-<src>``, one slot file in the own slots'
format. Transfers run over a gloo group of their own (never the training group, never the
checkpoint's), in a background thread: the loop only counts a *round* per publish. Every rank
runs the same rounds (one per publish, on every rank), so each round pairs a send with a
receive; a thread that fell behind sends nothing in its stale rounds, only its newest slot.

The receiver invalidates the replica's header first, receives the payload into the file,
verifies the header and the payload's digest (the sender's slot must have been complete and
unchanged while it was sent) and writes the header last: a node lost mid-transfer, or a slot
overwritten under the sender, leaves no replica, never a wrong one. Any failure of the peer
(gone, a protocol fault, tmpfs full) stops replicating with one WARNING until the next
rendezvous (the next worker processes).

On restore (:meth:`PeerReplica.fill`, collective), every rank lists its own slots' steps and
the replicas it keeps; the newest step every rank can load is chosen and each rank that lacks
it in its own slots (a fresh node) receives its replica from the peer that keeps it, into its
own slot, verified as above; the memory tier then applies it as any own slot
(``MemoryTier.restore``), naming the tier ``peer replica``.

Every byte received or read is untrusted (T-BOUNDED, T-FALL-BACK, T-SHARED-NODE): private
directory, ``O_NOFOLLOW`` 0600 files, sizes checked against the file system before anything is
allocated, the header parsed by the own slots' parser (``memtier._read_head``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from unbroken.ckpt.collectives import Comm
from unbroken.ckpt.memtier import (
    HEADER_BYTES,
    SLOTS,
    SlotDamaged,
    SlotStore,
    _read_head,
    payload_digest,
)
from unbroken.common.fs import PrivateDirError, open_private

__all__ = ["JUMP_ENV", "PREFIX", "PeerReplica", "jump"]

log = logging.getLogger(__name__)

PREFIX = "replica-of-"
JUMP_ENV = "UNBROKEN_MEMORY_JUMP"
"""Ranks per failure domain (node); default ``$LOCAL_WORLD_SIZE`` (torchrun sets it)."""

_MAGIC = 0x55425250  # "UBRP": the first word of every round's size message
_TAG_SIZE, _TAG_HEAD, _TAG_BODY = 0x5501, 0x5502, 0x5503  # background rounds
_TAG_FILL = 0x5511  # restore transfers (+0, +1, +2), never mixed with a round
_MIN_BYTES = HEADER_BYTES + 8
_NAME = re.compile(rf"({PREFIX}|rank-)(0|[1-9][0-9]{{0,8}})")


def jump(world: int) -> int:
    """Ranks per node (``$UNBROKEN_MEMORY_JUMP``, else ``$LOCAL_WORLD_SIZE``, else ``world``:
    one node, no replica)."""
    for name in (JUMP_ENV, "LOCAL_WORLD_SIZE"):
        raw = os.environ.get(name)
        if raw:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"${name}={raw!r} must be a positive integer") from None
            if value < 1:
                raise ValueError(f"${name}={raw!r} must be a positive integer")
            return value
    return world


def _wait(works: Sequence[Any]) -> None:
    for w in works:
        w.wait()


def _head_of(raw: bytes, path: str, size: int) -> Any:
    """The slot header in ``raw`` (``HEADER_BYTES``), parsed and checked by the own slots'
    parser against a file of ``size`` bytes."""
    fd = os.memfd_create("unbroken-replica-head", os.MFD_CLOEXEC)
    try:
        if os.pwrite(fd, raw, 0) != len(raw):
            raise SlotDamaged(path, "torn", "short header")
        return _read_head(fd, path, size)
    finally:
        os.close(fd)


def _fits(path: str, size: int) -> str | None:
    """Why a slot of ``size`` bytes cannot be received into ``path``'s file system."""
    if not _MIN_BYTES <= size < 1 << 50:
        return f"a slot of {size} bytes is out of range"
    st = os.statvfs(os.path.dirname(path))
    free = st.f_bavail * st.f_frsize
    if size > free:
        return f"a slot of {size} bytes does not fit in the {free} bytes free there"
    return None


def receive_slot(
    path: str, size: int, recv: Callable[[torch.Tensor, torch.Tensor], None], expect: dict[str, Any]
) -> Any:
    """Receive one slot file of ``size`` bytes into ``path`` (private, ``O_NOFOLLOW``):
    the header is invalidated first, ``recv(header, payload)`` fills a header buffer and the
    file's payload in place, the header and the payload checksum are verified and the header
    meta must match ``expect``; only then is the header written. Returns the header; raises
    :class:`SlotDamaged` (the file then holds no slot)."""
    why = _fits(path, size)
    if why is not None:
        raise SlotDamaged(path, "bad-header", why)
    try:
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
    except (OSError, PrivateDirError) as e:  # e.g. a symlink planted in its place
        # the bytes are on their way: take them (bounded by _fits) so the stream stays paired
        recv(
            torch.zeros(HEADER_BYTES, dtype=torch.uint8),
            torch.empty(size - HEADER_BYTES, dtype=torch.uint8),
        )
        raise SlotDamaged(path, "unreadable", str(e)) from None
    try:
        try:
            os.pwrite(fd, bytes(HEADER_BYTES), 0)  # invalidate first: a cut transfer is no slot
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # tmpfs full: ENOSPC here, not SIGBUS
        except OSError as e:
            recv(
                torch.zeros(HEADER_BYTES, dtype=torch.uint8),
                torch.empty(size - HEADER_BYTES, dtype=torch.uint8),
            )
            raise SlotDamaged(path, "unreadable", str(e)) from None
        head_buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        with _mapped(fd, size, writable=True) as mm:
            body = torch.frombuffer(
                mm, dtype=torch.uint8, count=size - HEADER_BYTES, offset=HEADER_BYTES
            )
            recv(head_buf, body)
            del body
            raw = head_buf.numpy().tobytes()
            head = _head_of(raw, path, size)
            with memoryview(mm) as whole, whole[HEADER_BYTES:] as payload:
                if payload_digest(payload) != head.digest:
                    raise SlotDamaged(path, "checksum", "payload checksum mismatch in transfer")
        other = [k for k, v in expect.items() if head.meta.get(k) != v]
        if other:
            raise SlotDamaged(
                path, "bad-header", f"another job's or rank's slot ({other[0]} differs)"
            )
        os.pwrite(fd, raw, 0)  # the header last
        return head
    finally:
        os.close(fd)


@contextlib.contextmanager
def _mapped(fd: int, size: int, *, writable: bool) -> Iterator[mmap.mmap]:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    try:
        yield mm
    finally:
        with contextlib.suppress(BufferError):  # a view still held: the mapping goes with it
            mm.close()


class _Outgoing:
    """A complete slot file, mapped read-only for sending (header checked first)."""

    def __init__(self, path: str) -> None:
        self.fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            self.size = os.fstat(self.fd).st_size
            self.head = _read_head(self.fd, path, self.size)
            self.mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(self.fd)
            raise
        with warnings.catch_warnings():  # read-only on purpose: gloo only reads it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            whole = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.parts = [whole[:HEADER_BYTES], whole[HEADER_BYTES:]]

    def close(self) -> None:
        self.parts.clear()
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)


class PeerReplica:
    """One rank's side of the ring (see the module docstring). Create it on every rank at
    the same point (:meth:`create` makes a process group: collective)."""

    def __init__(self, directory: str, comm: Comm, group: Any, step_jump: int) -> None:
        self.directory = directory
        self.rank, self.world = comm.rank, comm.world
        self.group = group
        self.dst = (self.rank + step_jump) % self.world
        self.src = (self.rank - step_jump) % self.world
        self.path = os.path.join(directory, f"{PREFIX}{self.src}")
        self.expect: dict[str, Any] = {}  # what the peer's slot header must name
        self.stopped: str | None = None  # why replicating stopped (logged once)
        self.received: int | None = None  # the step of the replica kept now (tests, logs)
        self._cv = threading.Condition()
        self._rounds = 0  # publishes not yet sent
        self._done = 0
        self._offered = 0
        self._latest: str | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._files: dict[tuple[int, int], str] = {}  # restore: the copies this rank holds

    @classmethod
    def create(cls, directory: str, comm: Comm) -> PeerReplica | None:
        """The replica for this rank, or None (one process, or one node). Collective when
        ``comm`` is: every rank creates the group, even where no peer is outside its node."""
        if not comm.enabled or comm.world < 2:
            return None
        group = dist.new_group(backend="gloo")
        step_jump = jump(comm.world)
        if step_jump % comm.world == 0:
            return None  # every rank on one node: no copy outside the failure domain
        return cls(directory, comm, group, step_jump)

    # --- publishing: one round per publish, in the background --------------------------------

    def offer(self, path: str) -> None:
        """A slot became complete (``path``): send it in the background. Never waits."""
        with self._cv:
            if self.stopped is not None or self.group is None:
                return
            self._offered += 1
            self._rounds += 1
            self._latest = path
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="unbroken-replica", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every offered slot's round ran (True), or ``timeout`` passed."""
        with self._cv:
            return self._cv.wait_for(
                lambda: self._done >= self._offered or self.stopped is not None, timeout
            )

    def close(self, timeout: float = 10.0) -> None:
        """Run the rounds offered so far, then end the thread (waits at most ``timeout``)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # stuck on a peer: leave its group alone
                return
        group, self.group = self.group, None
        # as the checkpoint's own groups (collectives.Comm.destroy): torn down while the
        # interpreter is intact; already gone with the script's destroy_process_group()
        with contextlib.suppress(Exception):
            if group is not None:
                dist.destroy_process_group(group)

    def remove(self) -> None:
        """Delete the replica this rank keeps (a clean end: the disk tier holds as much)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._rounds or self._closing)
                if not self._rounds:
                    return
                n, self._rounds = self._rounds, 0
                path = self._latest
            try:
                for i in range(n):  # rounds missed while busy carry nothing: only the newest
                    self._round(path if i == n - 1 else None)
            except Exception as e:  # noqa: BLE001 - the peer is gone: the disk tier remains
                self._stop(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
                return
            finally:
                with self._cv:
                    self._done += n
                    self._cv.notify_all()

    def _stop(self, why: str) -> None:
        with self._cv:
            self.stopped = why
            self._rounds = 0
            self._cv.notify_all()
        log.warning(
            "memory-tier peer replica off until the next rendezvous: rank %d cannot exchange "
            "with rank %d/%d (%s); a loss of this node falls back to the disk tier",
            self.rank, self.dst, self.src, why,
        )  # fmt: skip

    def _round(self, path: str | None) -> None:
        out: _Outgoing | None = None
        if path is not None:
            try:
                out = _Outgoing(path)
            except (OSError, PrivateDirError, SlotDamaged) as e:  # overwritten since: next one
                log.debug("replica: slot %s not sent (%s)", path, e)
        try:
            size = self._exchange_sizes(out)
            works = []
            if out is not None:
                works = [
                    dist.isend(p, self.dst, group=self.group, tag=t)
                    for p, t in zip(out.parts, (_TAG_HEAD, _TAG_BODY), strict=True)
                ]
            if size:
                self._receive(size)
            _wait(works)
        finally:
            if out is not None:
                out.close()

    def _exchange_sizes(self, out: _Outgoing | None) -> int:
        mine = _size_msg(out.head.step, out.size) if out else _size_msg(-1, 0)
        theirs = torch.zeros(3, dtype=torch.int64)
        _wait([
            dist.isend(mine, self.dst, group=self.group, tag=_TAG_SIZE),
            dist.irecv(theirs, self.src, group=self.group, tag=_TAG_SIZE),
        ])  # fmt: skip
        magic, _step, size = (int(v) for v in theirs.tolist())
        if magic != _MAGIC or (size and _fits(self.path, size) is not None):
            # the stream cannot be resynchronised: stop (the disk tier remains)
            raise ValueError(f"rank {self.src} sent a bad size message ({magic:#x}, {size})")
        return size

    def _receive(self, size: int) -> None:
        def recv(head: torch.Tensor, body: torch.Tensor) -> None:
            _wait([
                dist.irecv(head, self.src, group=self.group, tag=_TAG_HEAD),
                dist.irecv(body, self.src, group=self.group, tag=_TAG_BODY),
            ])  # fmt: skip

        try:
            self.received = receive_slot(self.path, size, recv, self._expect()).step
        except SlotDamaged as e:  # overwritten under the sender, or tampered: no replica
            self.received = None
            log.info("memory-tier replica of rank %d not kept: %s", self.src, e)

    def _expect(self) -> dict[str, Any]:
        return {**self.expect, "rank": self.src, "world": self.world}

    # --- restore: the newest step every rank can load, replicas sent where needed ------------

    def held(self) -> dict[tuple[int, int], str]:
        """(rank, step) -> file, for every copy of another rank's state in this directory
        that this process answers for (:meth:`_copies`; the first file of each)."""
        out: dict[tuple[int, int], str] = {}
        for x, step, path in self._copies():
            out.setdefault((x, step), path)
        return out

    def _copies(self) -> Iterator[tuple[int, int, str]]:
        """(rank, step, file) for every copy of another rank's state in this directory that
        this process answers for (names with a rank ``x`` of this local rank's residue): the
        replicas (``replica-of-<x>``, this rank's own included) and the slots of other
        ranks' directories (``rank-<x>``: the node's ranks were renumbered at the new
        rendezvous). Headers verified, this job's and naming ``x``."""
        lws = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in sorted(names):
            m = _NAME.fullmatch(name)
            if m is None or int(m.group(2)) >= self.world or int(m.group(2)) % lws != local:
                continue
            x = int(m.group(2))
            if m.group(1) == PREFIX:
                paths = [os.path.join(self.directory, name)]
            elif x != self.rank:
                paths = [os.path.join(self.directory, name, f"slot-{i}") for i in range(SLOTS)]
            else:
                continue  # this rank's own slots: the memory tier's own listing
            want = {**self.expect, "rank": x, "world": self.world}
            for path in paths:
                head = _check(path)
                if head is not None and all(head.meta.get(k) == v for k, v in want.items()):
                    yield x, head.step, path

    def drop_newer(self, step: int) -> list[int]:
        """Invalidate the copies this process answers for (:meth:`_copies`) of steps newer
        than ``step`` (the run rolled back to it: they are another trajectory's), once the
        rounds offered so far have run (none writes an older step after); returns those
        steps. Raises OSError when a copy cannot be invalidated."""
        self.drain()
        dropped = []
        for _, s, path in list(self._copies()):
            if s > step:
                fd = open_private(path, os.O_WRONLY | os.O_NONBLOCK)
                try:
                    os.pwrite(fd, bytes(HEADER_BYTES), 0)  # as a torn copy: never loaded
                finally:
                    os.close(fd)
                dropped.append(s)
        if self.received is not None and self.received > step:
            self.received = None
        return dropped

    def fill(
        self, comm: Comm, store: SlotStore, own: Sequence[int], disk_newest: int | None, ok: bool
    ) -> tuple[int | None, list[str]]:
        """Collective, before the memory tier's own restore. ``own``: the steps this rank's
        own slots hold (this job's, header verified); ``ok``: this rank can write its slots.
        When the newest step every rank can load needs replicas, each rank lacking it
        receives its own from the peer that keeps it, into one of its slots. Returns (that
        step when every rank now holds it, else None; notes for the restore line)."""
        self._files = self.held()
        gathered = comm.gather((sorted(own), sorted(self._files), ok))
        owns = [set(o) for o, _, _ in gathered]
        holder: dict[tuple[int, int], int] = {}
        for h, (_, items, _) in enumerate(gathered):
            for q, s in items:
                if q == h or (q, s) not in holder:  # a copy on the rank's own node first
                    holder[(q, s)] = h
        loadable = [
            owns[q] | ({s for (x, s) in holder if x == q} if gathered[q][2] else set())
            for q in range(self.world)
        ]
        common = set.intersection(*loadable)
        if not common:
            return None, []
        s = max(common)
        need = [q for q in range(self.world) if s not in owns[q]]
        if not need:
            return None, []  # the own slots hold it: nothing to send
        if disk_newest is not None and s < disk_newest:
            return None, [f"peer replica step {s} is older than disk step {disk_newest}"]
        why = self._transfer(store, s, {q: holder[(q, s)] for q in need})
        bad = [(q, w) for q, w in enumerate(comm.gather(why)) if w]
        if bad:
            q, w = bad[0]
            return None, [f"peer replica of rank {q} (step {s}) is damaged: {w}"]
        return s, [f"memory tier missing on rank(s) {need[:8]}: their copies on other nodes used"]

    def _transfer(self, store: SlotStore, step: int, plan: dict[int, int]) -> str | None:
        """Send each replica this rank keeps for a rank in ``plan`` (rank -> holder); receive
        this rank's own when it is in ``plan``. Three exchanges, each posted on every side
        before any waits (no pairing can deadlock): sizes, then the receiver's go-ahead
        (it checked the size fits), then the bytes. Returns why this rank's failed, or None."""
        g = self.group
        mine = sorted(q for q, h in plan.items() if h == self.rank and q != self.rank)
        h = plan.get(self.rank)
        local: str | None = None
        if h == self.rank:  # a copy of its own state on its node: no transfer
            local, h = self._copy_own(store, self._files[(self.rank, step)], step), None
        outs: dict[int, _Outgoing] = {}
        for q in mine:
            with contextlib.suppress(OSError, PrivateDirError, SlotDamaged):
                out = _Outgoing(self._files[(q, step)])
                if out.head.step == step:
                    outs[q] = out
                else:
                    out.close()
        try:
            sizes = {q: _size_msg(step, outs[q].size if q in outs else 0) for q in mine}
            works = [dist.isend(t, q, group=g, tag=_TAG_FILL) for q, t in sizes.items()]
            got = torch.zeros(3, dtype=torch.int64)
            if h is not None:
                works.append(dist.irecv(got, h, group=g, tag=_TAG_FILL))
            _wait(works)
            size, why = self._accept(store, got, h)
            acks = {q: torch.zeros(1, dtype=torch.int64) for q in mine}
            works = [dist.irecv(t, q, group=g, tag=_TAG_FILL + 3) for q, t in acks.items()]
            if h is not None:
                go = torch.tensor([int(why is None)], dtype=torch.int64)
                works.append(dist.isend(go, h, group=g, tag=_TAG_FILL + 3))
            _wait(works)
            works = [
                dist.isend(p, q, group=g, tag=_TAG_FILL + 1 + i)
                for q, t in acks.items()
                if int(t) == 1 and q in outs
                for i, p in enumerate(outs[q].parts)
            ]
            if h is not None and why is None:
                why = self._receive_own(store, h, size)
            _wait(works)
            return why or local
        finally:
            for out in outs.values():
                out.close()

    def _copy_own(self, store: SlotStore, path: str, step: int) -> str | None:
        """Copy this rank's state from another file on its node into one of its slots,
        verified as a transfer is (:func:`receive_slot`)."""
        try:
            out = _Outgoing(path)
        except (OSError, PrivateDirError, SlotDamaged) as e:
            return f"{path}: {e}"
        try:
            if out.head.step != step:
                return f"{path} changed (step {out.head.step})"

            def recv(head: torch.Tensor, body: torch.Tensor) -> None:
                head.copy_(out.parts[0])
                body.copy_(out.parts[1])

            store.forget()
            want = {**self.expect, "rank": self.rank, "world": self.world}
            receive_slot(store.slot_path(_free_slot(store)), out.size, recv, want)
        except SlotDamaged as e:
            return f"{os.path.basename(path)}: {e.reason}: {e.detail}"
        finally:
            out.close()
        return None

    def _accept(self, store: SlotStore, got: torch.Tensor, h: int | None) -> tuple[int, str | None]:
        """The size a holder announced, and why it is not received (None: receive it)."""
        if h is None:
            return 0, None
        magic, _step, size = (int(v) for v in got.tolist())
        if magic != _MAGIC or not size:
            return 0, f"rank {h} could not send it (its copy is missing or changed)"
        store.forget()  # a slot is rewritten from outside: no mapping of it may stay
        why = _fits(store.slot_path(_free_slot(store)), size)
        return size, None if why is None else f"from rank {h}: {why}"

    def _receive_own(self, store: SlotStore, h: int, size: int) -> str | None:
        def recv(head: torch.Tensor, body: torch.Tensor) -> None:
            _wait([
                dist.irecv(head, h, group=self.group, tag=_TAG_FILL + 1),
                dist.irecv(body, h, group=self.group, tag=_TAG_FILL + 2),
            ])  # fmt: skip

        want = {**self.expect, "rank": self.rank, "world": self.world}
        try:
            receive_slot(store.slot_path(_free_slot(store)), size, recv, want)
        except SlotDamaged as e:
            return f"from rank {h}: {e.reason}: {e.detail}"
        return None


def _size_msg(step: int, size: int) -> torch.Tensor:
    return torch.tensor([_MAGIC, step, size], dtype=torch.int64)


def _check(path: str) -> Any:
    """The header of the slot file at ``path`` when it verifies, else None."""
    try:
        fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, PrivateDirError):
        return None
    try:
        return _read_head(fd, path, os.fstat(fd).st_size)
    except SlotDamaged:
        return None
    finally:
        os.close(fd)


def _free_slot(store: SlotStore) -> int:
    """The own slot to receive into: one without a verified header, else the older one."""
    heads = [store.head(i) for i in range(SLOTS)]
    empty = [i for i, h in enumerate(heads) if h is None]
    if empty:
        return empty[0]
    return min(range(SLOTS), key=lambda i: heads[i].generation)  # type: ignore[union-attr]
