"""How a store is reached: :class:`StoreOptions` (retries, timeouts, part size, concurrency)
and the translation of fsspec-style ``storage_options`` into obstore's configuration.

Which path a URL takes (:func:`plan_route`):

* ``s3://``, ``gs://``, ``az://`` (also ``abfs://``, ``adl://``), ``http://``, ``https://``:
  obstore, with credentials and endpoint from the environment (``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
  ``AWS_ENDPOINT_URL``, web identity, container and instance credentials;
  ``GOOGLE_APPLICATION_CREDENTIALS``/``GOOGLE_SERVICE_ACCOUNT``; ``AZURE_STORAGE_ACCOUNT_NAME``,
  ``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_USE_EMULATOR``, ...) and from
  ``storage_options`` written for s3fs / gcsfs / adlfs (:data:`S3FS_KEYS` lists what maps
  where); plain HTTP only where the user named an ``http://`` endpoint (S3's
  ``endpoint_url``, a service-account file's ``gcs_base_url``, Azure's emulator);
* fsspec for every other scheme, and for any ``storage_options`` key obstore has no
  equivalent for (``profile``, ``s3_additional_kwargs``, ...), and for S3 when credentials
  live only in a botocore profile (``AWS_PROFILE`` or ``~/.aws/credentials``, which obstore
  does not read): what users already pass keeps working, at fsspec's speed. The reason is
  logged once per URL.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from unbroken.common.config import check_choice, check_count, check_flag, check_seconds

__all__ = ["OBSTORE_SCHEMES", "S3FS_KEYS", "Route", "StoreOptions", "plan_route"]

log = logging.getLogger(__name__)

OBSTORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "http", "https")


@dataclass(frozen=True)
class StoreOptions:
    """Retries, timeouts and transfer shape of one object store (see :func:`open_store`)."""

    retries: int = 5
    """extra attempts per request after a throttling reply (503 SlowDown, 429), a 5xx, a
    dropped connection or a timeout (count); waits grow from ``backoff_s``, with jitter."""
    backoff_s: float = 0.1
    """first wait before a retry (seconds); each next wait is up to twice as long."""
    max_backoff_s: float = 15.0
    """the longest wait between two attempts (seconds)."""
    timeout: float = 60.0
    """a request that moves no byte for this long fails (seconds), then is retried; also
    bounds connecting (at most 10 s) and a whole request (10x this)."""
    part_bytes: int = 8 << 20
    """multipart PUT part size, and the largest buffer a streamed GET hands over (bytes);
    8 MiB keeps a part's request cost below 1% of its transfer time while bounding memory to
    ``concurrency`` parts per file."""
    split_bytes: int = 64 << 20
    """the shortest range a download is split into (bytes): an object up to this size is
    one GET; a larger one is up to ``concurrency`` ranged GETs of about equal length, each
    streamed. Few long GETs, not one per part: some servers (moto, many gateways) read the
    whole object for every ranged GET, and each GET is a request billed and throttled."""
    concurrency: int = 8
    """ranged GETs in flight per downloaded file, parts in flight per uploaded file (count);
    object stores reward concurrency per connection up to a few dozen streams."""
    client: str = "auto"
    """``"auto"``: obstore where it serves the URL and options, else fsspec (module
    docstring); ``"fsspec"``: always fsspec; ``"obstore"``: obstore or a ValueError saying why
    not."""

    def __post_init__(self) -> None:
        own = "StoreOptions"
        check_count(own, "retries", self.retries, least=0)
        check_seconds(own, "backoff_s", self.backoff_s)
        check_seconds(own, "max_backoff_s", self.max_backoff_s)
        check_seconds(own, "timeout", self.timeout, positive=True)
        check_count(own, "part_bytes", self.part_bytes, least=5 << 20)
        check_count(own, "split_bytes", self.split_bytes, least=1 << 20)
        check_count(own, "concurrency", self.concurrency)
        check_choice(own, "client", self.client, ("auto", "obstore", "fsspec"))


@dataclass(frozen=True)
class Route:
    """Where a URL goes: ``kind`` ``"obstore"`` with ``config`` / ``client`` (obstore's store
    configuration and client options), or ``"fsspec"`` with ``why`` (one line for the log)."""

    kind: str
    config: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    client: dict[str, Any] = dataclasses.field(default_factory=dict)
    retry: dict[str, Any] = dataclasses.field(default_factory=dict)
    why: str = ""


# s3fs's keys -> obstore S3Config keys. ``None``: accepted and ignored (fsspec-side caching
# and instance knobs, and botocore's own response CRC: every byte is checked against its
# recorded xxh3-128 anyway).
S3FS_KEYS: dict[str, str | None] = {
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "endpoint_url": "endpoint",
    "region_name": "region",
    "anon": "skip_signature",
    "requester_pays": "request_payer",
    "skip_instance_cache": None,
    "use_listings_cache": None,
    "listings_expiry_time": None,
    "max_paths": None,
    "default_block_size": None,
    "default_fill_cache": None,
    "default_cache_type": None,
    "cache_regions": None,
    "asynchronous": None,
    "loop": None,
}
# botocore client keywords (``client_kwargs``) -> S3Config keys
_CLIENT_KWARGS: dict[str, str] = {
    "endpoint_url": "endpoint",
    "region_name": "region",
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "aws_session_token": "session_token",
}
# botocore Config keys (``config_kwargs``) obstore can honour; others send the URL to fsspec
_CONFIG_KWARGS = {
    "connect_timeout",
    "read_timeout",
    "retries",
    "region_name",
    "s3",
    "response_checksum_validation",
    "request_checksum_calculation",
    "max_pool_connections",
}
_S3_CONFIG = {"addressing_style", "payload_signing_enabled"}  # of config_kwargs["s3"]
# adlfs keys -> AzureConfig keys
_AZURE_KEYS: dict[str, str | None] = {
    "account_name": "account_name",
    "account_key": "account_key",
    "sas_token": "sas_key",
    "tenant_id": "tenant_id",
    "client_id": "client_id",
    "client_secret": "client_secret",
    "connection_string": None,  # handled below: not one key
}


def _fsspec(why: str) -> Route:
    return Route("fsspec", why=why)


def _seconds(v: Any) -> timedelta:
    return timedelta(seconds=float(v))


def client_options(opts: StoreOptions) -> dict[str, Any]:
    return {
        "connect_timeout": _seconds(min(opts.timeout, 10.0)),
        "read_timeout": _seconds(opts.timeout),
        "timeout": _seconds(opts.timeout * 10),
        "pool_idle_timeout": _seconds(60),
    }


def retry_config(opts: StoreOptions) -> dict[str, Any]:
    return {
        "max_retries": opts.retries,
        "backoff": {
            "init_backoff": _seconds(opts.backoff_s),
            "max_backoff": _seconds(max(opts.max_backoff_s, opts.backoff_s)),
            "base": 2,
        },
        "retry_timeout": _seconds(max(opts.timeout * 10, 60.0)),
    }


def plan_route(url: str, storage_options: Mapping[str, Any] | None, opts: StoreOptions) -> Route:
    """Which client serves ``url`` with these ``storage_options`` (see the module docstring)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in OBSTORE_SCHEMES:
        return _fsspec(f"scheme {scheme or 'file'!r} is served by fsspec")
    so = dict(storage_options or {})
    client = client_options(opts)
    retry = retry_config(opts)
    if scheme in ("http", "https"):
        unknown = sorted(so)
        if unknown:
            return _fsspec(f"storage_options {unknown} have no obstore equivalent for HTTP")
        return Route("obstore", {}, {**client, "allow_http": scheme == "http"}, retry)
    if scheme in ("gs", "gcs"):
        return _gcs(so, client, retry)
    if scheme in ("az", "abfs", "abfss", "adl"):
        return _azure(so, client, retry)
    return _s3(so, client, retry)


def _mapped(
    so: dict[str, Any],
    table: Mapping[str, str | None],
    lib: str,
    client: dict[str, Any],
    retry: dict[str, Any],
) -> Route:
    unknown = sorted(k for k in so if k not in table)
    if unknown:
        return _fsspec(f"{lib} storage_options {unknown} have no obstore equivalent")
    config = {t: v for k, v in so.items() if (t := table[k]) is not None}
    return Route("obstore", config, client, retry)


def _gcs(so: dict[str, Any], client: dict[str, Any], retry: dict[str, Any]) -> Route:
    """gcsfs's ``token``: a service-account file path or ``"anon"``; ``project`` is not needed
    for object access."""
    so = {k: v for k, v in so.items() if k != "project"}
    token = so.pop("token", None)
    if so:
        return _fsspec(f"gcsfs storage_options {sorted(so)} have no obstore equivalent")
    if token == "anon":
        return Route("obstore", {"skip_signature": True}, client, retry)
    if token is not None and not (isinstance(token, str) and os.path.isfile(token)):
        return _fsspec("gcsfs token other than a service-account file or 'anon'")
    env = os.environ.get("GOOGLE_SERVICE_ACCOUNT") or os.environ.get(
        "GOOGLE_APPLICATION_CREDENTIALS"
    )
    if _plain_http_base(token or env):  # the user named a plain-HTTP endpoint: allow it
        client["allow_http"] = True
    return Route("obstore", {} if token is None else {"service_account": token}, client, retry)


def _plain_http_base(service_account: str | None) -> bool:
    """The service-account file names a plain-HTTP ``gcs_base_url`` (a local emulator, as
    object_store's own tests use). A file that is not readable JSON is obstore's to report."""
    if not service_account:
        return False
    try:
        with open(service_account, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return False
    base = doc.get("gcs_base_url") if isinstance(doc, dict) else None
    return isinstance(base, str) and base.startswith("http://")


def _azure(so: dict[str, Any], client: dict[str, Any], retry: dict[str, Any]) -> Route:
    if "connection_string" in so:
        return _fsspec("adlfs connection_string is not parsed here")
    return _mapped(so, _AZURE_KEYS, "adlfs", client, retry)


def _s3(so: dict[str, Any], client: dict[str, Any], retry: dict[str, Any]) -> Route:
    config: dict[str, Any] = {}
    nested = {"client_kwargs", "config_kwargs"}
    unknown = sorted(k for k in so if k not in S3FS_KEYS and k not in nested)
    ck = dict(so.get("client_kwargs") or {})
    unknown += sorted(f"client_kwargs.{k}" for k in ck if k not in _CLIENT_KWARGS)
    cfg = dict(so.get("config_kwargs") or {})
    unknown += sorted(f"config_kwargs.{k}" for k in cfg if k not in _CONFIG_KWARGS)
    s3cfg = dict(cfg.get("s3") or {})
    unknown += sorted(f"config_kwargs.s3.{k}" for k in s3cfg if k not in _S3_CONFIG)
    if unknown:
        return _fsspec(f"s3fs storage_options {unknown} have no obstore equivalent")
    for k in ("endpoint_url", "region_name"):
        for where, d in (("", so), ("client_kwargs.", ck)):
            if d.get(k) is not None and not isinstance(d[k], str):
                raise ValueError(
                    f"storage_options.{where}{k}={d[k]!r} must be a string (a URL or a name)"
                )
    for k, v in so.items():
        target = S3FS_KEYS.get(k)
        if target is not None and v is not None:
            config[target] = v
    for k, v in ck.items():
        if v is not None:
            config[_CLIENT_KWARGS[k]] = v
    _botocore_config(cfg, config, client, retry)
    if config.get("skip_signature") is not True:
        config.pop("skip_signature", None)
    if not _has_s3_credentials(config):
        why = _profile_only()
        if why:
            return _fsspec(why)
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or ""
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL", "")
    if endpoint.startswith("http://"):  # the user named a plain-HTTP endpoint: allow it
        client["allow_http"] = True
    signing = s3cfg.get("payload_signing_enabled")
    if signing is not None:
        check_flag("storage_options", "config_kwargs.s3.payload_signing_enabled", signing)
        config["unsigned_payload"] = not signing
    elif not (
        config.get("skip_signature")
        or endpoint.startswith("http://")
        or "AWS_UNSIGNED_PAYLOAD" in os.environ
    ):
        # botocore's rule for S3: the payload's SHA-256 is signed over plain HTTP only; over
        # HTTPS, TLS protects the body. Signing costs a SHA-256 of every byte uploaded.
        config["unsigned_payload"] = True
    return Route("obstore", config, client, retry)


def _botocore_config(
    cfg: dict[str, Any], config: dict[str, Any], client: dict[str, Any], retry: dict[str, Any]
) -> None:
    """botocore ``Config`` keywords (``config_kwargs``) into obstore's three option sets."""
    if cfg.get("region_name"):
        config["region"] = cfg["region_name"]
    for name in ("connect_timeout", "read_timeout"):
        if name in cfg:
            check_seconds("storage_options", f"config_kwargs.{name}", cfg[name], positive=True)
            client[name] = _seconds(cfg[name])
    # botocore's client config: ``max_attempts`` counts the retries, ``total_max_attempts``
    # the first attempt too, and wins when both are given; obstore counts retries
    tries = dict(cfg.get("retries") or {})
    for name, first in (("max_attempts", 0), ("total_max_attempts", 1)):
        if tries.get(name) is not None:
            check_count(
                "storage_options", f"config_kwargs.retries.{name}", tries[name], least=first
            )
            retry["max_retries"] = tries[name] - first
    style = (cfg.get("s3") or {}).get("addressing_style")
    if style in ("virtual", "path"):
        config["virtual_hosted_style_request"] = style == "virtual"


def _has_s3_credentials(config: Mapping[str, Any]) -> bool:
    if config.get("skip_signature") or config.get("access_key_id"):
        return True
    env = os.environ
    return bool(
        env.get("AWS_ACCESS_KEY_ID")
        or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    )


def _profile_only() -> str:
    """Why S3 credentials can only come from a botocore profile here, or ``""``: obstore
    reads the environment and instance metadata, not ``~/.aws``."""
    if os.environ.get("AWS_PROFILE"):
        return "AWS_PROFILE is set (obstore does not read botocore profiles)"
    path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    if os.path.isfile(path):
        return f"credentials come from {path} (obstore does not read botocore profiles)"
    return ""
