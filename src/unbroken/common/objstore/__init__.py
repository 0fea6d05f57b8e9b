"""One object-store layer for both lifelines: verified ranged GETs, verified (multipart) PUTs,
list, head and delete, on obstore for ``s3://``, ``gs://``, ``az://`` and ``http(s)://`` and on
fsspec for everything else (see :mod:`.options` for which URL and options go where).

    store = open_store("s3://bucket/dataset", {"client_kwargs": {"endpoint_url": ...}})
    store.get_file("shard-000.tar", "/nvme/cache/shard-000.tar", size=n, checksum=xxh3)
    store.put_file("step-100/__0_0.distcp", fd, size=n, checksum=xxh3)
    store.list_objects("step-100")  # {"step-100/__0_0.distcp": n, ...}

Errors name the URL: :class:`~unbroken.common.errors.ObjectMismatch` (bytes other than
recorded), ``FileNotFoundError`` (no such object),
:class:`~unbroken.common.errors.RemoteStorageError` (the store failed after its retries).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from unbroken.common.errors import ObjectMismatch, RemoteStorageError
from unbroken.common.objstore.base import ObjectStore
from unbroken.common.objstore.options import Route, StoreOptions, plan_route

__all__ = [
    "ObjectMismatch",
    "ObjectStore",
    "RemoteStorageError",
    "StoreOptions",
    "obstore_runtime_here",
    "open_store",
    "route_of",
]

log = logging.getLogger(__name__)
_told: set[tuple[str, str]] = set()


def obstore_runtime_here() -> bool:
    """Whether this process has run an obstore request: a child it forks is then served by
    fsspec, so a helper process that should use obstore is better started fresh (spawn)."""
    import sys

    mod = sys.modules.get("unbroken.common.objstore._obstore")
    return bool(mod is not None and mod.runtime_here())


def route_of(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    options: StoreOptions | None = None,
) -> Route:
    """Which client :func:`open_store` would use for ``url`` (``Route.kind``) and why."""
    opts = options or StoreOptions()
    if opts.client == "fsspec":
        return Route("fsspec", why="StoreOptions(client='fsspec')")
    route = plan_route(url, storage_options, opts)
    if opts.client == "obstore" and route.kind != "obstore":
        raise ValueError(
            f"{url}: StoreOptions(client='obstore') but obstore cannot serve it: {route.why}; "
            "use client='auto' (fsspec then serves it) or change the options"
        )
    return route


def open_store(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    options: StoreOptions | None = None,
) -> ObjectStore:
    """The :class:`ObjectStore` rooted at ``url`` (``s3://bucket/prefix``, ``gs://...``,
    ``az://container/...``, ``https://host/dir``, ``file:///mnt/x`` or any fsspec URL).

    ``storage_options``: what s3fs / gcsfs / adlfs take (``key``, ``secret``,
    ``endpoint_url``, ``client_kwargs={"endpoint_url": ..., "region_name": ...}``,
    ``config_kwargs={"retries": {"max_attempts": n}, ...}``, ``anon``, ...), mapped to obstore;
    a key obstore has no equivalent for sends this URL to fsspec with the options as given
    (logged once). Credentials otherwise come from the environment as each SDK reads them.
    """
    opts = options or StoreOptions()
    route = route_of(url, storage_options, opts)
    if route.kind == "obstore":
        from unbroken.common.objstore._obstore import ObstoreStore

        return ObstoreStore(url, opts, route, storage_options)
    if (url, route.why) not in _told and "://" in url and not url.startswith("file://"):
        _told.add((url, route.why))
        log.info("%s: served by fsspec (%s)", url, route.why)
    from unbroken.common.objstore._fsspec import FsspecStore

    return FsspecStore(url, opts, storage_options)
