"""The request path of the remote cache: everything that asks an object store for bytes.

A store is reached through the object-store layer (:mod:`unbroken.common.objstore`: obstore
for ``s3://``, ``gs://``, ``az://`` and ``http(s)://``, fsspec for any other scheme and for
``storage_options`` obstore has no equivalent for), with the cache's timeout, retries and
backoff; a unit's two files (shard and index) are downloaded by
:func:`~unbroken.data.prepare.stage.fetch_verified` - ranged GETs of at most the size
dataset.json records + 1, hashed (xxh3-128) as they arrive and ``pwrite``-n into a temporary
file renamed into place only on a match. ``dataset.json`` is read through fsspec, with
retries: one request, in the rank process, which must not start obstore's runtime before it
forks its DataLoader workers and the fetcher (that runtime does not survive a fork). Where
fsspec has no backend for the scheme (``gs://`` without gcsfs, ``az://`` without adlfs),
that one request is made through obstore in a fresh interpreter instead.
The cache calls only :func:`open_store`, :func:`load_remote_manifest` and
:func:`download_unit`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from unbroken.common.fs import checksum_file
from unbroken.common.objstore import ObjectStore, StoreOptions, route_of
from unbroken.common.objstore import open_store as _open_store
from unbroken.data.manifest import (
    MANIFEST_NAME,
    DatasetManifest,
    ManifestError,
    join_path,
    manifest_bytes,
)
from unbroken.data.prepare.stage import RemoteStorageError, fetch_verified
from unbroken.data.stream.config import CacheConfig

__all__ = [
    "ObjectStore",
    "RemoteStorageError",
    "check_files",
    "download_unit",
    "import_request_path",
    "load_remote_manifest",
    "open_store",
    "with_timeouts",
]


_PART = 64 << 20


def with_timeouts(url: str, opts: Any, timeout: float) -> dict[str, Any]:
    """The caller's storage options plus per-call timeouts for s3fs (which defaults to none
    shorter than a minute and retries inside botocore); fresh fsspec instances, because a
    cached async instance does not survive a fork into a DataLoader worker."""
    out = dict(opts or {})
    out.setdefault("skip_instance_cache", True)
    if url.startswith(("s3://", "s3a://")):
        cfg = dict(out.get("config_kwargs") or {})
        cfg.setdefault("connect_timeout", min(timeout, 10.0))
        cfg.setdefault("read_timeout", timeout)
        # Every file is checked against dataset.json's xxh3-128; botocore's own CRC of each
        # response body (on by default since botocore 1.36) would only cost CPU a second time.
        cfg.setdefault("response_checksum_validation", "when_required")
        out["config_kwargs"] = cfg
    return out


def open_store(url: str, options: dict[str, Any], config: CacheConfig) -> ObjectStore:
    """The object store of a remote dataset root (``options``: its storage options, with
    timeouts); requests retried ``config.retries`` times from ``config.backoff_s``."""
    return _open_store(url, options, _store_options(config))


def import_request_path(url: str, options: dict[str, Any], config: CacheConfig) -> None:
    """Import now, in the calling thread, the modules :func:`open_store` imports on its first
    call. A reader process forks its DataLoader workers and its fetcher while its own
    download threads may be opening their first store; a fork while one of them is inside an
    import leaves the child that module half made, its import lock held by a thread the
    child does not have: the child hangs at its first use of it, or gets "cannot import name
    'ObstoreStore' from partially initialized module" (seen in a DataLoader worker, issue 22
    tmpleft). Nothing is opened or started here (obstore's runtime starts at a request)."""
    if route_of(url, options, _store_options(config)).kind == "obstore":
        for name in ("obstore.store", "unbroken.common.objstore._obstore"):
            importlib.import_module(name)
    else:
        import fsspec

        importlib.import_module("unbroken.common.objstore._fsspec")
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        # its implementation (s3fs, gcsfs, ...); one missing is the first download's to report
        with contextlib.suppress(ImportError, ValueError):
            fsspec.get_filesystem_class(protocol)


def _store_options(config: CacheConfig) -> StoreOptions:
    return StoreOptions(
        retries=config.retries,
        backoff_s=config.backoff_s,
        timeout=config.timeout,
        # One streamed GET per shard below 2 x split_bytes (128 MiB): the cache's own threads
        # are its concurrency (several shards in flight), and every extra ranged part is a
        # request the server pays for (against moto, 8 parts of a 64 MiB object cost 7x the
        # server CPU of one GET: benchmarks/objstore_get.py). 64 MiB parts keep fsspec's path
        # (one GET per part) at one GET per shard too. Memory: ``threads`` x 2 buffers.
        part_bytes=_PART,
        concurrency=2,
    )


def load_remote_manifest(url: str, config: CacheConfig) -> DatasetManifest:
    """``dataset.json`` at ``url``, retried like a shard; a store that does not answer raises
    :class:`RemoteStorageError` naming the URL."""
    opts = with_timeouts(url, config.storage_options, config.timeout)
    if not _fsspec_serves(url) and route_of(url, opts, _store_options(config)).kind == "obstore":
        return _manifest_in_child(url, opts, config)
    for attempt in range(config.retries + 1):
        try:
            return DatasetManifest.load(url, opts)
        except (FileNotFoundError, ValueError):
            raise  # no manifest there / a damaged one: not an outage
        except Exception as e:
            if attempt == config.retries:
                raise RemoteStorageError(
                    f"{join_path(url, 'dataset.json')}: reading the manifest failed after "
                    f"{attempt + 1} attempt(s) ({type(e).__name__}: {e}); the storage is "
                    "unreachable or failing - check endpoint, credentials and network"
                ) from e
            time.sleep(config.backoff_s * 2**attempt)
    raise AssertionError("unreachable")  # pragma: no cover


def _fsspec_serves(url: str) -> bool:
    """Whether fsspec has an implementation for ``url``'s scheme importable here."""
    import fsspec

    try:
        fsspec.get_filesystem_class(url.split("://", 1)[0] if "://" in url else "file")
    except (ImportError, ValueError):
        return False
    return True


# what the child's exit status means; 2 (any other failure): RemoteStorageError
_CHILD_EXIT = {3: FileNotFoundError, 4: ManifestError, 5: ValueError}


def _manifest_in_child(url: str, opts: dict[str, Any], config: CacheConfig) -> DatasetManifest:
    """``dataset.json`` through obstore, read by a fresh interpreter (this process must not
    start obstore's runtime: it forks DataLoader workers next). Its bytes are parsed here,
    as any manifest's: the child is trusted no more than the store."""
    so = _store_options(config)
    try:
        payload = json.dumps(
            {"opts": opts, "retries": so.retries, "backoff_s": so.backoff_s, "timeout": so.timeout}
        )
    except TypeError as e:
        raise ValueError(
            f"{url}: storage_options cannot be handed to the manifest reader ({e}); install "
            "the fsspec backend for this scheme (gs://: gcsfs, az://: adlfs) or pass plain values"
        ) from None
    code = "from unbroken.data.stream.remote.fetch import _manifest_child; _manifest_child()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    limit = (config.timeout + config.backoff_s * 2**config.retries) * (config.retries + 1) + 30
    try:
        p = subprocess.run(
            [sys.executable, "-c", code, url],
            input=payload.encode(),
            capture_output=True,
            timeout=limit,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise RemoteStorageError(
            f"{join_path(url, MANIFEST_NAME)}: reading the manifest did not finish in "
            f"{limit:.0f} s; the storage is unreachable or failing - check endpoint, "
            "credentials and network",
            url=url,
        ) from None
    if p.returncode == 0:
        return DatasetManifest.parse(p.stdout, source=join_path(url, MANIFEST_NAME))
    lines = p.stderr.decode("utf-8", "replace").strip().splitlines()
    said = lines[-1] if lines else f"exit status {p.returncode}"
    raise _CHILD_EXIT.get(p.returncode, RemoteStorageError)(said)


def _manifest_child() -> None:
    """The child of :func:`_manifest_in_child`: the manifest's bytes to stdout; exit 3 for
    no manifest, 4 for one refused unread, 5 for a store configuration obstore refuses (not
    an outage: a retry or a restart cannot mend it), 2 for a store that failed."""
    url = sys.argv[1]
    job = json.loads(sys.stdin.read())
    so = StoreOptions(retries=job["retries"], backoff_s=job["backoff_s"], timeout=job["timeout"])
    try:
        raw = manifest_bytes(_open_store(url, job["opts"], so))
    except (FileNotFoundError, ValueError) as e:
        code = 3 if isinstance(e, FileNotFoundError) else 4 if isinstance(e, ManifestError) else 5
        said = str(e)
    except Exception as e:  # noqa: BLE001 - the parent raises it, named
        code, said = 2, f"{join_path(url, MANIFEST_NAME)}: {type(e).__name__}: {e}"
    else:
        sys.stdout.buffer.write(raw)
        sys.stdout.flush()
        return
    print(" ".join(said.split()), file=sys.stderr)
    sys.exit(code)


def download_unit(
    store: ObjectStore,
    url: str,
    names: Sequence[str],
    files: Sequence[tuple[str, int]],
    checksums: Sequence[str],
    config: CacheConfig,
    on_bytes: Callable[[int], None],
) -> None:
    """Download a unit's files (``names`` under the store root, to the local ``files`` of the
    sizes dataset.json records), each verified against its checksum before it is published
    (0600); raises naming the file's URL after ``config.retries`` re-fetches."""
    for name, (path, size), checksum in zip(names, files, checksums, strict=True):
        fetch_verified(
            store,
            name,
            path,
            size,
            checksum,
            url=join_path(url, name),
            retries=config.retries,
            backoff_s=config.backoff_s,
            on_bytes=on_bytes,
            what="caching",
            private=True,
        )


def check_files(files: Sequence[tuple[str, int]], checksums: Sequence[str]) -> str | None:
    """The first of ``files`` (local path, size) whose size and whole-file xxh3-128 differ
    from what dataset.json records; None when all match."""
    for (path, size), want in zip(files, checksums, strict=True):
        try:
            got = checksum_file(path)
        except OSError:
            return path
        if got != (size, want):
            return path
    return None
