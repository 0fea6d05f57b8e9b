"""`StatefulLoader`: torch's DataLoader over a StreamingDataset, with an O(1) resume state
(D-RESUME).

Its state (the ``Stateful`` protocol; plain JSON, the same on every rank) is the dataset's
fingerprint (D-FINGERPRINT), the seed, the epoch and ``samples_consumed``: the *global*
positions of the epoch already consumed, advanced in whole global steps
(``start + k * world_size * batch_size`` after ``k`` batches). It counts batches
*delivered* to the caller, never those prefetched by workers, less the last
``held_batches`` (a loop that draws the next batch before the step ends holds it across a
save; ``held_batches=1`` leaves it unconsumed). After the last batch of an epoch it reads
``{epoch + 1, samples_consumed: 0}``.

``load_state_dict`` only stores those numbers: the next iteration starts at global position
``samples_consumed`` with the *new* world size, batch size and worker count, so the union
of all ranks' batches after a resume is exactly the rest of the uninterrupted sequence, and
no skipped sample is read. :meth:`StatefulLoader.forever` is the endless view for
``next()``-style loops.

The state dict in full: ARCHITECTURE.md, "Design notes" > data > the loader's state.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

# torch's worker loop seeds numpy.random in every DataLoader worker, and numpy 2 imports it
# lazily: a training process that has not imported it yet has each worker import it after its
# fork (~10 ms per worker, on every start of the workers: a resume waits on it). Imported
# here, the workers inherit it.
import numpy.random
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from unbroken.common.config import configure
from unbroken.common.text import printable
from unbroken.data.feed.prefetch import map_tensors
from unbroken.data.stream.config import LoaderConfig
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.stream.order import Partition, mix_seed
from unbroken.data.stream.transport import RingReceiver, RingSender, transport_available, worker_fds

__all__ = ["Endless", "LoaderConfig", "StatefulLoader"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


def _passthrough(batch: Any) -> Any:
    # Batches are collated in the workers; the DataLoader must not touch them again.
    return batch


def _stack_rows(batch: list[np.ndarray]) -> np.ndarray:
    return np.stack(batch)


def _xy_rows(batch: list[Any]) -> tuple[np.ndarray, ...]:
    """``LoaderConfig.xy``: rows of ``seq_len + 1`` tokens -> contiguous ``(x, y)`` (``(x, y,
    ids)`` for ``(row, id)`` samples), made in the worker: one copy each, where the rows are
    gathered anyway, so the training process gets tensors it can ``view(-1)``."""
    ids = None
    if batch and isinstance(batch[0], tuple):
        ids = np.asarray([i for _, i in batch], dtype=np.int64)
        batch = [r for r, _ in batch]
    rows = np.stack(batch)
    x, y = np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])
    return (x, y) if ids is None else (x, y, ids)


def _xy_tensors(batch: list[Any]) -> tuple[torch.Tensor, ...]:
    # through the shared-memory ring: tensors, which it packs into a slot
    return tuple(torch.from_numpy(a) for a in _xy_rows(batch))


def _as_tensors(batch: Any) -> Any:
    """A numpy batch (an array, or a tuple of them) as tensors on the same memory."""
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch)
    if isinstance(batch, tuple) and all(isinstance(a, np.ndarray) for a in batch):
        return tuple(torch.from_numpy(a) for a in batch)
    return batch


class _RunStream(IterableDataset):
    """One run (epoch, start .. epoch end) of a dataset, as whole batches per worker."""

    def __init__(
        self,
        dataset: StreamingDataset,
        epoch: int,
        start: int,
        batch_size: int,
        last_batch: str,
        collate_fn: Callable[[list[Any]], Any],
        ring: bool = False,
        ring_fds: list[tuple[int, int, int]] | None = None,
        first: int = 0,
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.epoch = epoch
        self.start = start
        self.batch_size = batch_size
        self.last_batch = last_batch
        self.collate_fn = collate_fn
        self.ring = ring  # False: batches take torch's stock pipe
        self.ring_fds = ring_fds or []  # one memfd per worker, inherited by forked workers
        self.first = first  # batches of the run made by the loader itself
        self._sender: RingSender | None = None  # per worker process, made there

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        collate = self.collate_fn
        if info is not None and self.ring:
            # A persistent worker keeps its ring (and its mapped pages) from epoch to epoch.
            if self._sender is None:
                spec = self.ring_fds[wid] if wid < len(self.ring_fds) else None
                self._sender = RingSender(worker_id=wid, fd_spec=spec)
            collate = functools.partial(self._sender.collate, collate_fn=self.collate_fn)
        yield from self.dataset.iter_batches(
            self.epoch,
            self.start,
            self.batch_size,
            last_batch=self.last_batch,
            collate_fn=collate,
            worker_id=wid,
            num_workers=nw,
            first=self.first,
        )
        # A persistent worker keeps this object: the next pass after a complete one is the
        # next epoch from its start (the loader rebuilds the workers for any other start).
        self.epoch += 1
        self.start = 0
        self.first = 0

    def __getstate__(self) -> dict[str, Any]:
        # spawn/forkserver workers build their own ring
        return {**self.__dict__, "_sender": None}


class StatefulLoader:
    """A ``torch.utils.data.DataLoader`` whose batches and state are layout-independent.

    The batches a rank receives depend only on (dataset, seed, epoch, resume position,
    batch size, world size) - not on ``num_workers``, ``prefetch_factor`` or
    ``persistent_workers``. See the module docstring for the state dict.

    With workers, the first batch of each run (an epoch, or the rest of one after a resume)
    is made in this process before the workers start - the same batch a worker would make -
    so it does not wait for forking the workers and their start-up (first batch of a resume:
    tens of ms sooner); the workers are started when the loop asks for the second batch.
    Not with a ``worker_init_fn`` (the transform may depend on it), nor when persistent
    workers already run that epoch.

    ``StatefulLoader(dataset, config=None, *, collate_fn=None, worker_init_fn=None,
    multiprocessing_context=None, generator=None, **overrides)``:

    * ``dataset``: the :class:`StreamingDataset` (it fixes the order, rank and world size);
    * ``config``: a :class:`~unbroken.data.LoaderConfig` (what each option does, its unit and
      default); the keywords are fields of it, applied over ``config``
      (``StatefulLoader(ds, batch_size=32, num_workers=4, pin_memory=True)``).
      ``last_batch`` is the one spelling of torch's ``drop_last`` (``"drop"``; ``"pad"``, the
      default, and ``"short"`` are the other policies). ``shm_transport``: with workers,
      batches cross to this process through a ring of reusable shared-memory slots per
      worker instead of torch's pipe: tensors are collated straight into a slot and arrive
      without a copy - pinned, when ``pin_memory=True`` on CUDA (the slot is registered once;
      torch's pin-memory thread and its copy are not used); small tensor-free batches keep
      the pipe, which is faster for them (see :mod:`unbroken.data.stream.transport`);
    * ``collate_fn``: builds a batch from a list of samples, in the worker (default
      ``torch.utils.data.default_collate``); ``worker_init_fn``,
      ``multiprocessing_context``, ``generator``: as ``DataLoader``.
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        config: LoaderConfig | None = None,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        **overrides: Any,
    ) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(
                f"StatefulLoader needs a StreamingDataset, got {type(dataset).__name__}; wrap "
                "your data with unbroken.data.StreamingDataset(dir)"
            )
        if "drop_last" in overrides:
            raise TypeError(
                "StatefulLoader() takes last_batch, not drop_last: drop_last=True is "
                "last_batch='drop' (the other policies: 'pad', the default, repeats the samples "
                "just before the last batch so every rank gets full batches; 'short' keeps a "
                "short last batch)"
            )
        order = sorted({"shuffle", "sampler", "batch_sampler"} & set(overrides))
        if order:
            raise TypeError(
                f"StatefulLoader() takes no {', '.join(order)}: the order is the dataset's, "
                "so that a resume can find its place in it - StreamingDataset(dir, seed=S) "
                "shuffles (shard order per epoch, then within a window), shuffle=False keeps "
                "the stored order; ranks split it by StreamingDataset(rank=, world_size=)"
            )
        c = self.config = configure(LoaderConfig, config, overrides, owner="StatefulLoader")
        self.dataset = dataset
        ring = c.shm_transport and c.num_workers > 0 and transport_available()
        if c.pin_memory and c.pin_memory_device and not c.pin_memory_device.startswith("cuda"):
            ring = False  # another accelerator's pinned memory: torch's pin thread does it
        self._ring = ring
        # Token rows with the default collate: through the ring, default_collate stacks them
        # into a slot (a LongTensor that arrives without a copy); otherwise they are stacked
        # in the worker into one numpy array that crosses the pipe in one piece and becomes
        # a tensor here without a copy - same LongTensor as default_collate gives, without a
        # shared-memory segment per batch (which costs more than the copy at language-model
        # batch sizes).
        tokens = (
            collate_fn is None
            and dataset.kind == "tokens"
            and not dataset.transform
            and not dataset.config.with_ids  # (row, id) pairs: default_collate makes (tokens, ids)
        )
        if c.xy:
            _check_xy(dataset, collate_fn)
        self._from_numpy = (tokens or c.xy) and not ring
        # without CUDA there is no pinned memory: batches come unpinned (as torch's DataLoader)
        self._pin_here = self._from_numpy and c.pin_memory and torch.cuda.is_available()
        if c.xy:
            self.collate_fn: Callable[[list[Any]], Any] = _xy_tensors if ring else _xy_rows
        elif self._from_numpy:
            self.collate_fn = _stack_rows
        else:
            self.collate_fn = collate_fn or default_collate
        self._pin_ring = ring and c.pin_memory
        self._dl_kwargs: dict[str, Any] = dict(
            num_workers=c.num_workers,
            prefetch_factor=c.prefetch_factor,
            # the ring pins by registration; the numpy token path pins here
            pin_memory=c.pin_memory and not ring and not self._pin_here,
            persistent_workers=c.persistent_workers,
            timeout=c.timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            pin_memory_device=c.pin_memory_device,
        )
        self._epoch = 0
        self._start = 0
        self._run: tuple[int, int, int] | None = None  # (run id, epoch, start) in flight
        self._run_steps = 0  # global steps of the run in flight
        self._delivered = 0
        # The position before each of the last held_batches delivered batches: a held batch
        # may belong to an earlier run (the epoch before), whose position _position cannot
        # recompute from the run in flight.
        self._before: deque[tuple[int, int]] = deque(maxlen=c.held_batches)
        self._ids = itertools.count()
        # A persistent DataLoader and the (epoch, start) its workers will run next.
        self._dl: DataLoader | None = None
        self._dl_next: tuple[int, int] | None = None
        self._rx: RingReceiver | None = None  # the persistent DataLoader's rings

    # --- position ------------------------------------------------------------------------

    def _position(self, held: int = 0) -> tuple[int, int]:
        """(epoch, global samples consumed) after the batches delivered so far, less the
        last ``held`` of them (batches the loop holds, not consumed: the saved position)."""
        if held and self._before:  # fewer delivered since the restore: the restored position
            return self._before[-min(held, len(self._before))]
        if self._run is None:
            return self._epoch, self._start
        _, epoch, start = self._run
        done = max(0, self._delivered - held)
        if done >= self._run_steps:
            return epoch + 1, 0
        part = self.dataset.partition(start, self.config.batch_size, self.config.last_batch)
        return epoch, part.consumed_after(done)

    @property
    def epoch(self) -> int:
        return self._position()[0]

    @property
    def samples_consumed(self) -> int:
        return self._position()[1]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning - unless it is the current epoch (resume)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch={epoch!r} must be a non-negative int")
        cur, _ = self._position()
        if epoch != cur:
            self._run = None
            self._epoch, self._start = epoch, 0
            self._before.clear()

    def forever(self) -> Endless:
        """Batches epoch after epoch, without end, for loops that draw with ``next(...)``
        (nanoGPT's ``X, Y = get_batch()``): an iterator whose ``state_dict`` and
        ``load_state_dict`` are this loader's (so ``DevicePrefetcher(loader.forever())`` is
        Stateful too)."""
        return Endless(self)

    def __len__(self) -> int:
        """Batches this rank gets in the rest of the current epoch."""
        _, start = self._position()
        return self.dataset.partition(
            start, self.config.batch_size, self.config.last_batch
        ).num_batches()

    # --- iteration -----------------------------------------------------------------------

    def _dataloader(self, epoch: int, start: int, first: int) -> tuple[DataLoader, RingReceiver]:
        persistent = self._dl_kwargs["persistent_workers"]
        if persistent and self._dl is not None and self._dl_next == (epoch, start):
            if self._rx is None:
                raise RuntimeError("StatefulLoader: persistent DataLoader without its receiver")
            return self._dl, self._rx
        fds = worker_fds(self.config.num_workers) if self._ring else None
        stream = _RunStream(
            self.dataset,
            epoch,
            start,
            self.config.batch_size,
            self.config.last_batch,
            self.collate_fn,
            self._ring,
            fds,
            first,
        )
        kwargs = dict(self._dl_kwargs)
        if kwargs["generator"] is None:
            # Each DataLoader iterator draws its workers' base seed from this generator; left
            # at None, it is drawn from the *global* torch RNG, so a run resumed mid-epoch
            # (one iterator more than the uninterrupted run) would shift the model's dropout
            # stream. Seeded by the position instead: worker seeds also survive a resume.
            kwargs["generator"] = torch.Generator().manual_seed(
                mix_seed(self.dataset.config.seed, epoch, start)
            )
        dl = DataLoader(stream, batch_size=None, collate_fn=_passthrough, in_order=True, **kwargs)
        rx = RingReceiver(fds, pin=self._pin_ring)
        # Drop the old persistent workers now: they would replay a stale run.
        if self._rx is not None:
            self._rx.close()
        self._dl, self._rx = (dl, rx) if persistent else (None, None)
        self._dl_next = None
        return dl, rx

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._position()
        part = self.dataset.partition(start, self.config.batch_size, self.config.last_batch)
        run_id = next(self._ids)
        self._run = (run_id, epoch, start)
        self._run_steps = part.num_steps
        self._delivered = 0
        return self._generate(run_id, epoch, start)

    def _generate(self, run_id: int, epoch: int, start: int) -> Iterator[Any]:
        it: Any = None
        rx: RingReceiver | None = None
        try:
            first = 0
            batches = self.dataset.partition(
                start, self.config.batch_size, self.config.last_batch
            ).num_batches()
            if batches and self._first_here(epoch, start):
                # The run's first batch is made here, before the workers start: forking them
                # and their start-up (tens of ms; most of the latency of a resume) come when
                # the loop asks for the second batch, not before the first. Same batch as a
                # worker makes (it depends only on the position; the transform's RNGs are
                # seeded by it and this process's RNG states are put back).
                batch = self._batch_here(epoch, start)
                self._deliver()
                yield batch
                if self._run is None or self._run[0] != run_id:
                    return  # load_state_dict / set_epoch replaced this run
                first = 1
            dl: DataLoader | None = None
            if first < batches:  # else the run was one batch: no worker started for it
                dl, rx = self._dataloader(epoch, start, first)
                it = iter(dl)
            unpack = rx.unpack if rx is not None else _passthrough
            for item in it if it is not None else ():
                if self._run is None or self._run[0] != run_id:
                    return
                batch = unpack(item)
                if self._from_numpy:
                    batch = _as_tensors(batch)
                    if self._pin_here:
                        batch = map_tensors(lambda t: t.pin_memory(), batch)
                self._deliver()
                yield batch
            if self._run is not None and self._run[0] == run_id:
                self._epoch, self._start = epoch + 1, 0
                self._run = None
                if dl is not None and self._dl is dl:
                    self._dl_next = (epoch + 1, 0)
        finally:
            if self._run is not None and self._run[0] == run_id:
                # abandoned mid-epoch (break, exception): keep the delivered position
                self._epoch, self._start = self._position()
                self._run = None
            del it
            if rx is not None and rx is not self._rx:
                rx.close()

    def _deliver(self) -> None:
        """Count one more batch delivered to the loop, remembering the position before it."""
        if self._before.maxlen:
            self._before.append(self._position())
        self._delivered += 1

    def _first_here(self, epoch: int, start: int) -> bool:
        """Make the run's first batch in this process: only when workers are about to be
        started for it (not for persistent workers already running it), and only without a
        ``worker_init_fn`` (the transform may need what it sets up in a worker)."""
        if self.config.num_workers == 0 or self._dl_kwargs["worker_init_fn"] is not None:
            return False
        return self._dl is None or self._dl_next != (epoch, start)

    def _batch_here(self, epoch: int, start: int) -> Any:
        batches = self.dataset.iter_batches(
            epoch,
            start,
            self.config.batch_size,
            last_batch=self.config.last_batch,
            collate_fn=self.collate_fn,
        )
        batch = next(batches)
        del batches  # a generator: closed here
        if self._from_numpy:
            batch = _as_tensors(batch)
        if self.config.pin_memory and torch.cuda.is_available():
            batch = map_tensors(lambda t: t if t.is_pinned() else t.pin_memory(), batch)
        return batch

    # --- Stateful ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches the loop consumed: those delivered, less the
        ``held_batches`` it still holds (LoaderConfig)."""
        return self._state(self.config.held_batches)

    def delivered_state_dict(self) -> dict[str, Any]:
        """The position after every batch delivered, held ones included: where a new pass
        continues (a DevicePrefetcher rewinds to it when it drops batches it pulled ahead;
        rewound to :meth:`state_dict`, it would deliver the held batches twice)."""
        return self._state(0)

    def _state(self, held: int) -> dict[str, Any]:
        epoch, consumed = self._position(held)
        ds = self.dataset
        sd: dict[str, Any] = {
            "version": _STATE_VERSION,
            "fingerprint": ds.fingerprint,
            "seed": ds.config.seed,
            "epoch": epoch,
            "samples_consumed": consumed,
            "shuffle_window": list(ds.shuffle_window),
        }
        if ds.config.windows != "fixed":
            sd["windows"] = ds.config.windows
        if len(ds.sources) > 1:
            sd["sources"] = [
                {"fingerprint": fp, "weight": w}
                for fp, w in zip(ds.source_fingerprints, ds.weights, strict=True)
            ]
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position: O(1), reads nothing (see the module docstring)."""
        ds = self.dataset
        try:
            version = _state_int(state, "version")
            fp = printable(state["fingerprint"])
            seed = _state_int(state, "seed", bounded=False)  # any seed DatasetConfig takes
            epoch = _state_int(state, "epoch")
            consumed = _state_int(state, "samples_consumed")
            saved = state.get("shuffle_window", ds.shuffle_window)
            if not isinstance(saved, list | tuple):
                raise ValueError(f"shuffle_window={printable(repr(saved))[:80]} is not a list")
            window = [_state_int({"shuffle_window": w}, "shuffle_window") for w in saved]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"not a StatefulLoader state dict (missing or bad field {e}); expected keys "
                "version, fingerprint, seed, epoch, samples_consumed"
            ) from None
        if version != _STATE_VERSION:
            raise ValueError(
                f"loader state version {version} is not supported (this unbroken writes "
                f"{_STATE_VERSION})"
            )
        windows = printable(state.get("windows", "fixed"))
        if windows != ds.config.windows:
            raise ValueError(
                f"the loader state was saved with windows={windows!r} but the dataset has "
                f"windows={ds.config.windows!r}; construct StreamingDataset(..., windows="
                f"{windows!r}) to resume the same samples"
            )
        if seed != ds.config.seed:
            raise ValueError(
                f"the loader state was saved with seed={seed} but the dataset has "
                f"seed={ds.config.seed}; construct StreamingDataset(..., seed={seed}) to resume the "
                "same order"
            )
        # The fingerprint first: a position beyond a dataset that shrank is a changed dataset.
        if fp == ds.fingerprint and (epoch < 0 or not 0 <= consumed <= ds.epoch_length):
            raise ValueError(
                f"loader state epoch={epoch} samples_consumed={consumed} is outside this "
                f"dataset's epoch of {ds.epoch_length} samples"
            )
        if fp != ds.fingerprint:
            if self.config.on_dataset_change != "restart_epoch":
                raise ValueError(
                    f"the dataset changed since the checkpoint: the loader state was saved on "
                    f"dataset fingerprint {fp}, but {', '.join(s.root for s in ds.sources)} "
                    f"has fingerprint {ds.fingerprint}{_which_source(state, ds)}."
                    f"{_older_version(fp, state, ds)} Resuming "
                    f"would misalign the order{_beyond(epoch, consumed, ds)}. Restore the "
                    "original data, or pass "
                    "StatefulLoader(..., on_dataset_change='restart_epoch') to restart epoch "
                    f"{epoch} from its first sample."
                )
            log.warning(
                "dataset fingerprint changed (%s -> %s): restarting epoch %d from its first "
                "sample as on_dataset_change='restart_epoch' asks",
                fp,
                ds.fingerprint,
                epoch,
            )
            if epoch < 0:
                raise ValueError(f"loader state epoch={epoch} must be >= 0")
            consumed = 0
        elif window != list(ds.shuffle_window):
            raise ValueError(
                f"the loader state was saved with shuffle_window={window} but the dataset has "
                f"{list(ds.shuffle_window)}; pass StreamingDataset(..., shuffle_window="
                f"{window[0]}) (or shuffle=False when it is 0) to resume the same order"
            )
        self._run = None
        self._epoch, self._start = epoch, consumed
        self._before.clear()

    def stats(self) -> dict[str, int]:
        """Counters of the data path: ``corrupt_skipped``, damaged samples left out under
        ``StreamingDataset(..., on_corrupt="skip")`` (summed over all workers)."""
        return {"corrupt_skipped": self.dataset.corrupt_skipped}

    def __repr__(self) -> str:
        epoch, consumed = self._position()
        return (
            f"StatefulLoader({self.dataset!r}, batch_size={self.config.batch_size}, "
            f"num_workers={self.config.num_workers}, epoch={epoch}, samples_consumed={consumed})"
        )


class Endless:
    """:meth:`StatefulLoader.forever`: the loader's batches, epoch after epoch."""

    def __init__(self, loader: StatefulLoader) -> None:
        self.loader = loader
        self._it: Generator[Any, None, None] | None = None
        self._taken = loader._position(loader.config.held_batches)

    def take_ids(self) -> list[int]:
        """The ids of the samples the loop consumed since the last call (or since the start or
        the restore), every rank's, in the order a one-rank run consumes them: what
        ``MetricLog.log(step, ids=...)`` wants, with no collective and no ``with_ids`` (ids
        are a pure function of the order). A batch the loop holds (``held_batches``) is not
        consumed yet; a sample left out by ``on_corrupt="skip"`` is still listed."""
        loader = self.loader
        (e0, p0), now = self._taken, loader._position(loader.config.held_batches)
        self._taken = now
        out: list[int] = []
        ds, c = loader.dataset, loader.config
        n, g = ds.epoch_length, c.batch_size * ds.world_size
        for epoch in range(e0, now[0] + 1):
            start = p0 if epoch == e0 else 0
            # One rank taking the global batch: every rank's batches in one-rank order, the
            # epoch's last step as last_batch makes it (padded, dropped or short).
            part = Partition(start, n, g, 0, 1, c.last_batch)
            steps = part.num_steps
            if epoch == now[0]:
                steps = min(steps, -(-(now[1] - start) // g))
            full = min(steps, (n - start) // g)
            pos = np.arange(start, start + full * g, dtype=np.int64)
            if steps > full:
                pos = np.concatenate([pos, part.batch_positions(full)])
            if pos.size:
                out += ds.sample_ids(epoch, pos).tolist()
        return out

    def __iter__(self) -> Endless:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = _epochs(self.loader)  # not a method: no cycle keeps workers alive
        return next(self._it)

    def close(self) -> None:
        """Stop the workers of the epoch in flight now (the position stays)."""
        it, self._it = self._it, None
        if it is not None:
            it.close()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def delivered_state_dict(self) -> dict[str, Any]:
        return self.loader.delivered_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The loader resumes there; the next batch comes from the restored position."""
        self.loader.load_state_dict(state)
        self.close()
        self._taken = self.loader._position(self.loader.config.held_batches)


def _epochs(loader: StatefulLoader) -> Generator[Any, None, None]:
    while True:
        if loader.samples_consumed == 0 and not len(loader):
            # every epoch gives this rank nothing: next() would spin through epochs forever
            ds, c = loader.dataset, loader.config
            smaller = (
                f" or a batch_size of at most {ds.epoch_length // ds.world_size}"
                if c.last_batch == "drop" and ds.epoch_length >= ds.world_size
                else ""
            )
            raise ValueError(
                f"StatefulLoader.forever(): an epoch of {ds.epoch_length} samples gives rank "
                f"{ds.rank} of {ds.world_size} no batch with batch_size={c.batch_size}, "
                f"last_batch={c.last_batch!r}, so next() would never return; pass "
                f"last_batch='pad' (every rank gets full batches){smaller}"
            )
        yield from loader


def _state_int(state: dict[str, Any], key: str, *, bounded: bool = True) -> int:
    """A field of a saved state as a non-negative int (below 2**63 when ``bounded``): a
    checkpoint is a file, and a float, bool or string there is refused, not truncated into
    a position the loop trains on."""
    v = state[key]
    if type(v) is not int or v < 0 or (bounded and v >= 2**63):
        raise ValueError(
            f"{key}={printable(repr(v))[:80]} is not an integer in [0, "
            f"{'2**63)' if bounded else 'inf)'}"
        )
    return v


def _check_xy(dataset: StreamingDataset, collate_fn: Any) -> None:
    if dataset.kind != "tokens":
        raise ValueError(
            f"StatefulLoader(xy=True) splits token rows into inputs and targets; "
            f"{dataset!r} is a {dataset.kind} dataset - drop xy"
        )
    if collate_fn is not None:
        raise ValueError(
            "StatefulLoader(xy=True) is its own collate (contiguous x, y); pass xy or "
            "collate_fn, not both"
        )


def _beyond(epoch: int, consumed: int, ds: StreamingDataset) -> str:
    if 0 <= consumed <= ds.epoch_length:
        return ""
    return (
        f" (its position, sample {consumed} of epoch {epoch}, lies beyond the "
        f"{ds.epoch_length} samples the dataset now holds)"
    )


def _older_version(fp: str, state: dict[str, Any], ds: StreamingDataset) -> str:
    """A sentence when the state carries a fingerprint as unbroken computed it before issue 20:
    the data may be unchanged, but neither its identity nor its order can be carried over."""
    saved = {fp}
    for s in state.get("sources") or ():
        if isinstance(s, dict):
            saved.add(str(s.get("fingerprint")))
    if saved.isdisjoint(ds.source_fingerprints_v1):
        return ""
    return (
        " The state was saved by an unbroken that read dataset.json version 1, whose "
        "fingerprint did not cover the indexes; this version fingerprints every field, and "
        "the epoch order follows the fingerprint, so the saved position does not carry over "
        "(finish that run with the unbroken that started it, or restart the epoch)."
    )


def _which_source(state: dict[str, Any], ds: StreamingDataset) -> str:
    saved = state.get("sources")
    if not isinstance(saved, list) or len(saved) != len(ds.sources):
        return ""
    diff = [
        f"{src.root} ({printable(old.get('fingerprint'))} -> {new})"
        for src, old, new in zip(ds.sources, saved, ds.source_fingerprints, strict=True)
        if isinstance(old, dict) and old.get("fingerprint") != new
    ]
    return f" (changed: {', '.join(diff)})" if diff else ""
