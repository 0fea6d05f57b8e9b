"""The request path of the remote cache: everything that asks an object store for bytes.

A store is reached through fsspec (``storage_options``: endpoint, credentials) with per-call
timeouts; ``dataset.json`` is read with retries; a unit's two files (shard and index) are
downloaded by :func:`~unbroken.data.prepare.stage.fetch_verified` - ranged GETs of at most the
size dataset.json records + 1, checked against its xxh3-128 before they are renamed into place.
Another request path (another client library) plugs in here: the cache calls only
:func:`open_store`, :func:`load_remote_manifest` and :func:`download_unit`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from unbroken.common.fs import checksum_file
from unbroken.data.manifest import DatasetManifest, join_path
from unbroken.data.prepare.stage import RemoteStorageError, fetch_verified
from unbroken.data.stream.config import CacheConfig

__all__ = [
    "RemoteStorageError",
    "check_files",
    "download_unit",
    "load_remote_manifest",
    "open_store",
    "with_timeouts",
]


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


def open_store(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """(filesystem, root path) of a remote dataset root."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **options)
    return fs, str(root)


def load_remote_manifest(url: str, config: CacheConfig) -> DatasetManifest:
    """``dataset.json`` at ``url``, retried like a shard; a store that does not answer raises
    :class:`RemoteStorageError` naming the URL."""
    opts = with_timeouts(url, config.storage_options, config.timeout)
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


def download_unit(
    store: tuple[Any, str],
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
    fs, root = store
    for name, (path, size), checksum in zip(names, files, checksums, strict=True):
        fetch_verified(
            fs,
            root.rstrip("/") + "/" + name,
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
