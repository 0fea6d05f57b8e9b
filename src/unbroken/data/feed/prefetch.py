"""Device prefetcher: the next batch is already in GPU memory when the step ends.

``DevicePrefetcher`` wraps any iterable of batches (a ``StatefulLoader``, a plain
``DataLoader``, a generator) and keeps ``depth`` batches in flight on the device: host
tensors pinned (unless the loader pinned them already), copied with ``non_blocking=True``
on a side stream, an optional GPU ``transform`` run there too; the compute stream never
reads a batch before its copy and transform finished. On CPU (``device`` None or
``"cpu"``, or no CUDA) it is a transparent pass-through, so one script runs everywhere.

State (the ``Stateful`` protocol, D-RESUME): ``state_dict()`` is the wrapped loader's
state that belongs to the last batch *delivered* to the loop, not to the batches
prefetched behind it; ``load_state_dict()`` forwards to the loader and drops in-flight
batches. A batch the loop holds across a save is the loader's to count:
``DevicePrefetcher(loader.forever())`` with ``StatefulLoader(..., held_batches=1)``.

The streams, events and ``record_stream`` rules: ARCHITECTURE.md, "Design notes" > data >
the device prefetcher.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["DevicePrefetcher", "CopyObserver", "batch_nbytes", "map_tensors"]

_log = logging.getLogger(__name__)

#: ``callback(nbytes, start_event, end_event)``: told about each delivered batch's H2D copy.
CopyObserver = Callable[[int, Any, Any], None]

_NO_STATE = object()


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor of a nested batch; rebuild the containers.

    Handles dicts (and Mapping subclasses that accept a dict), lists, tuples, namedtuples
    and dataclass instances; any other leaf (str, int, None, numpy array...) is returned
    unchanged, as ``DataLoader``'s ``pin_memory`` does.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(fn, v) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # e.g. defaultdict: its first argument is the factory
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: map_tensors(fn, getattr(batch, f.name))
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def _visit_tensors(fn: Callable[[torch.Tensor], None], batch: Any) -> None:
    """Call ``fn`` on every tensor of a nested batch without rebuilding anything."""
    if isinstance(batch, torch.Tensor):
        fn(batch)
    elif isinstance(batch, Mapping):
        for v in batch.values():
            _visit_tensors(fn, v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _visit_tensors(fn, v)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            _visit_tensors(fn, getattr(batch, f.name))


def batch_nbytes(batch: Any) -> int:
    """Total bytes of all tensors in a nested batch."""
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        total += t.numel() * t.element_size()

    _visit_tensors(add, batch)
    return total


def _resolve_device(device: str | torch.device | None) -> torch.device | None:
    """None means the CPU pass-through; CUDA asked for but absent degrades to it too."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            _log.warning(
                "DevicePrefetcher: device=%s but CUDA is not available; "
                "passing batches through on the CPU",
                dev,
            )
            return None
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclasses.dataclass
class _InFlight:
    batch: Any  # device batch, already transformed
    host: Any  # pinned host batch: kept alive until ``ready`` completed (copy source)
    ready: Any = None  # torch.cuda.Event recorded on the side stream after copy+transform
    nbytes: int = 0
    copy_start: Any = None  # timing events, only when an observer is attached
    copy_end: Any = None
    state: Any = _NO_STATE  # _snapshot() taken right after the pull


class _CudaCopier:
    """The stream and event discipline of the CUDA path, kept in one place."""

    def __init__(
        self,
        device: torch.device,
        transform: Callable[[Any], Any] | None,
        non_blocking: bool,
        pin_memory: bool,
    ) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.transform = transform
        self.non_blocking = non_blocking
        self.pin_memory = pin_memory
        self.timed = False

    def begin(self) -> None:
        # A new pass: whatever the compute stream did before it (model init, constants a
        # transform captures) must be visible to the side stream. Once per pass, so the
        # copies still run ahead of the steps that follow.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def enqueue(self, host: Any) -> _InFlight:
        dev, stream = self.device, self.stream
        saw_cuda = False

        def pin(t: torch.Tensor) -> torch.Tensor:
            nonlocal saw_cuda
            if t.device.type != "cpu":
                saw_cuda = True
                return t
            return t.pin_memory() if self.pin_memory and not t.is_pinned() else t

        host = map_tensors(pin, host)
        if saw_cuda:
            # Tensors produced on the compute stream: the side stream must see that work
            # before it reads them (rare: loaders normally yield CPU tensors).
            stream.wait_stream(torch.cuda.current_stream(dev))
        start = end = None
        with torch.cuda.stream(stream):
            if self.timed:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            batch = map_tensors(lambda t: t.to(dev, non_blocking=self.non_blocking), host)
            if self.timed:
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
            if self.transform is not None:
                batch = self.transform(batch)
            ready = torch.cuda.Event()
            ready.record(stream)
        return _InFlight(batch, host, ready, batch_nbytes(host), start, end)

    def deliver(self, entry: _InFlight) -> None:
        compute = torch.cuda.current_stream(self.device)
        # The step's kernels queue behind the copy + transform of this batch...
        compute.wait_event(entry.ready)
        # ...and its memory, allocated on the side stream, is not reused by a later
        # side-stream allocation until the compute stream's uses of it have finished.
        _visit_tensors(lambda t: _record_on(t, compute), entry.batch)

    def done(self, entry: _InFlight) -> bool:
        return bool(entry.ready.query())

    def synchronize(self) -> None:
        self.stream.synchronize()


class _HostCopier:
    """No device: the batch is its own copy. Used to exercise the queue logic on CPU."""

    def __init__(self, transform: Callable[[Any], Any] | None) -> None:
        self.transform = transform
        self.timed = False

    def begin(self) -> None:
        pass

    def enqueue(self, host: Any) -> _InFlight:
        batch = self.transform(host) if self.transform is not None else host
        return _InFlight(batch, host)

    def deliver(self, entry: _InFlight) -> None:
        pass

    def done(self, entry: _InFlight) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_Copier = _CudaCopier | _HostCopier


class DevicePrefetcher:
    """Keep ``depth`` batches in flight on ``device``; see the module docstring.

    Args:
        iterable: any iterable of batches (tensors, dicts, tuples, lists, nested). When it
            has ``state_dict``/``load_state_dict`` the prefetcher speaks the same protocol.
        device: ``None``/``"cpu"`` -> pass-through; ``"cuda"``/``"cuda:N"``/a
            ``torch.device`` -> prefetch there (pass-through when CUDA is unavailable);
            other accelerator types get a plain synchronous ``.to(device)``.
        depth: batches held ready on the device beyond the one being computed on. 2 covers
            one copy plus one transform in flight; more only costs device memory.
        transform: ``fn(device_batch) -> device_batch``, run on the side stream (CUDA) or
            on the CPU batch in pass-through mode.
        non_blocking: issue asynchronous copies (needs pinned host memory to overlap).
        pin_memory: pin host tensors that are not pinned yet before copying. Pinning in the
            training process is a synchronous memcpy; prefer a loader that delivers pinned
            batches - ``StatefulLoader(pin_memory=True)`` (no copy at all) or
            ``DataLoader(pin_memory=True)`` (a copy in its pin thread); already pinned tensors
            are detected and not pinned twice.

    Host-side waiting for the wrapped loader happens inside ``next()`` on the calling
    thread: the loader's own buffer (``num_workers x prefetch_factor``) absorbs its
    jitter; ``depth`` hides copy and transform latency.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        device: str | torch.device | None = None,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
        non_blocking: bool = True,
        pin_memory: bool = True,
        *,
        _copier: _Copier | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(
                f"DevicePrefetcher: depth={depth!r} must be an int >= 1 "
                "(batches kept in flight); pass depth=2"
            )
        if transform is not None and not callable(transform):
            raise ValueError(
                f"DevicePrefetcher: transform={transform!r} is not callable; "
                "pass a function device_batch -> device_batch or None"
            )
        self._iterable = iterable
        self.depth = depth
        self._transform = transform
        self._non_blocking = non_blocking
        self._device = _resolve_device(device)
        self._copier: _Copier | None = _copier
        if self._copier is None and self._device is not None and self._device.type == "cuda":
            self._copier = _CudaCopier(self._device, transform, non_blocking, pin_memory)
        self._it: Iterator[Any] | None = None
        self._queue: collections.deque[_InFlight] = collections.deque()
        self._retiring: collections.deque[_InFlight] = collections.deque()
        self._exhausted = False
        self._done = False  # a pass ended: next() keeps raising StopIteration until iter()
        self._error: BaseException | None = None
        self._delivered_state: Any = _NO_STATE
        self._observer: CopyObserver | None = None

    # -- properties ----------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where delivered batches live (``cpu`` in pass-through mode)."""
        return self._device if self._device is not None else torch.device("cpu")

    @property
    def passthrough(self) -> bool:
        """True when batches are handed on as they come (no device, nothing in flight)."""
        return self._copier is None

    @property
    def in_flight(self) -> int:
        """Batches pulled from the wrapped loader but not delivered yet."""
        return len(self._queue)

    def observe_copies(self, callback: CopyObserver | None) -> None:
        """Register ``callback(nbytes, start_event, end_event)`` for each delivered batch.

        Used by :class:`unbroken.data.diagnose.timer.StepTimer` to account H2D copy time with CUDA
        events; called on the CUDA path only (the pass-through copies nothing).
        """
        self._observer = callback
        if self._copier is not None:
            self._copier.timed = callback is not None and isinstance(self._copier, _CudaCopier)

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    # -- iteration -----------------------------------------------------------------------

    def __iter__(self) -> DevicePrefetcher:
        # Like DataLoader: every ``for`` starts a fresh pass over the wrapped iterable.
        self._drop_in_flight()
        self._start()
        return self

    def __next__(self) -> Any:
        if self._it is None:
            if self._done:
                raise StopIteration
            self._start()
        if self._copier is None:
            return self._next_direct()
        self._fill()
        if not self._queue:
            return self._finish()
        entry = self._queue.popleft()
        self._copier.deliver(entry)
        if self._observer is not None and entry.copy_start is not None:
            self._observer(entry.nbytes, entry.copy_start, entry.copy_end)
        self._delivered_state = entry.state
        batch, entry.batch = entry.batch, None
        self._retiring.append(entry)
        self._release_finished()
        # Refill now, so the next copies queue up behind this step's compute launch.
        self._fill()
        return batch

    def _start(self) -> None:
        self._it = iter(self._iterable)
        self._exhausted = False
        self._done = False
        self._error = None
        if self._copier is not None:  # only the queued path pulls ahead of delivery
            self._copier.begin()
            self._delivered_state = self._snapshot()

    def _finish(self) -> Any:
        self._it = None
        self._done = True
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        raise StopIteration

    def _next_direct(self) -> Any:
        if self._it is None:  # pragma: no cover - _start ran in __next__
            raise StopIteration
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = None
            self._done = True
            raise
        if self._device is not None:  # non-CUDA accelerator: no streams to overlap on
            dev = self._device
            batch = map_tensors(lambda t: t.to(dev, non_blocking=self._non_blocking), batch)
        return self._transform(batch) if self._transform is not None else batch

    def _fill(self) -> None:
        copier = self._copier
        while copier is not None and len(self._queue) < self.depth and not self._exhausted:
            if self._it is None:  # pragma: no cover - _start ran in __next__
                return
            try:
                host = next(self._it)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as e:  # noqa: BLE001 - raised after the batches already in flight
                self._exhausted = True
                self._error = e
                return
            state = self._snapshot()
            entry = copier.enqueue(host)
            entry.state = state
            self._queue.append(entry)

    def _release_finished(self) -> None:
        # The pinned source of a copy must outlive the copy; let it go once the event says
        # the side stream is past it.
        copier = self._copier
        while copier is not None and self._retiring and copier.done(self._retiring[0]):
            self._retiring.popleft()

    def _drop_in_flight(self, rewind: bool = True) -> None:
        pulled_ahead = bool(self._queue)  # pulled from the loader, never delivered
        if self._copier is not None and (self._queue or self._retiring):
            self._copier.synchronize()
        self._queue.clear()
        self._retiring.clear()
        it, self._it = self._it, None
        close = getattr(it, "close", None)
        if close is not None:
            close()  # run the wrapped iterator's cleanup now (e.g. stop DataLoader workers)
        if rewind and pulled_ahead and self._delivered_state is not _NO_STATE:
            # The loader counted the dropped batches as consumed; put it back at the last
            # delivered one, so a new pass neither skips nor repeats a batch.
            load = getattr(self._iterable, "load_state_dict", None)
            if load is not None:
                load(copy.deepcopy(self._delivered_state[1]))
        self._exhausted = False
        self._done = False
        self._error = None

    def close(self) -> None:
        """Drop in-flight batches (waits for their copies) and the wrapped iterator; a
        Stateful loader is put back at the last delivered batch."""
        self._drop_in_flight()

    # -- Stateful ------------------------------------------------------------------------

    def _snapshot(self) -> Any:
        """(the state to save, the state a new pass continues from): they differ by the
        batches the loop holds across a save (``StatefulLoader(held_batches=...)``)."""
        sd = getattr(self._iterable, "state_dict", None)
        if sd is None:
            return _NO_STATE
        here = getattr(self._iterable, "delivered_state_dict", sd)
        # deepcopy: the loader may mutate the dict it returned as it advances.
        return copy.deepcopy(sd()), copy.deepcopy(here())

    def state_dict(self) -> Any:
        """The wrapped loader's state as of the last batch delivered to the caller."""
        sd = getattr(self._iterable, "state_dict", None)
        if sd is None:
            raise RuntimeError(
                f"DevicePrefetcher: the wrapped {type(self._iterable).__name__} has no "
                "state_dict(); wrap a StatefulLoader (or any object with "
                "state_dict/load_state_dict) to checkpoint the data position"
            )
        if self._delivered_state is _NO_STATE:
            return sd()  # nothing pulled ahead of delivery: the live state is the one
        return copy.deepcopy(self._delivered_state[0])

    def load_state_dict(self, state: Any) -> None:
        """Forward to the wrapped loader; batches in flight belong to the old position."""
        load = getattr(self._iterable, "load_state_dict", None)
        if load is None:
            raise RuntimeError(
                f"DevicePrefetcher: the wrapped {type(self._iterable).__name__} has no "
                "load_state_dict(); it cannot resume a data position"
            )
        self._drop_in_flight(rewind=False)
        load(state)
        self._delivered_state = _NO_STATE


def _record_on(t: torch.Tensor, stream: Any) -> None:
    if t.is_cuda:
        t.record_stream(stream)
