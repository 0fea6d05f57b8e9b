"""Which client serves a URL, and how fsspec-style storage_options become obstore's
configuration (issue 22 item 1). Pure: no server; the requests themselves are proved in
tests/integration/test_objstore.py."""

from __future__ import annotations

import pickle
import re
from datetime import timedelta
from typing import Any

import pytest

from unbroken.common.errors import ObjectMismatch, RemoteStorageError
from unbroken.common.objstore import StoreOptions, open_store, route_of
from unbroken.common.objstore.base import parts


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for k in (
        "AWS_ACCESS_KEY_ID",
        "AWS_PROFILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-such-file"))


def test_s3fs_keys_map_to_obstore_config() -> None:
    """issue 22 item 1: key/secret/token, endpoint_url and region in client_kwargs, botocore
    timeouts and retries, addressing style, anon."""
    r = route_of(
        "s3://b/p",
        {
            "key": "AK",
            "secret": "SK",
            "token": "TK",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
            "config_kwargs": {
                "retries": {"max_attempts": 1},
                "connect_timeout": 2,
                "read_timeout": 7,
                "s3": {"addressing_style": "path"},
                "response_checksum_validation": "when_required",
            },
            "skip_instance_cache": True,
        },
    )
    assert r.kind == "obstore"
    assert r.config == {
        "access_key_id": "AK",
        "secret_access_key": "SK",
        "session_token": "TK",
        "endpoint": "http://127.0.0.1:9000",
        "region": "eu-west-1",
        "virtual_hosted_style_request": False,
    }
    assert r.client["allow_http"] is True  # the user named a plain-http endpoint
    assert r.client["connect_timeout"] == timedelta(seconds=2)
    assert r.client["read_timeout"] == timedelta(seconds=7)
    assert r.retry["max_retries"] == 1  # botocore's client max_attempts counts retries
    for tries, retries in [
        ({"max_attempts": 0}, 0),
        ({"total_max_attempts": 1}, 0),  # counts the first attempt
        ({"total_max_attempts": 4, "max_attempts": 9}, 3),  # and wins, as in botocore
    ]:
        r = route_of("s3://b/p", {"key": "AK", "secret": "SK", "config_kwargs": {"retries": tries}})
        assert r.retry["max_retries"] == retries, tries
    assert route_of("s3://b", {"anon": True}).config == {"skip_signature": True}
    assert route_of("s3://b", {"endpoint_url": "https://x"}).config == {
        "endpoint": "https://x",
        "unsigned_payload": True,  # https: as botocore (see the test below)
    }
    assert "allow_http" not in route_of("s3://b", {"endpoint_url": "https://x"}).client


def test_payloads_are_signed_over_plain_http_only_as_botocore_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Signing a PUT's payload is a SHA-256 of every byte uploaded (x-amz-content-sha256; 1.8
    GB/s of one core here: ~1.2 CPU-s of a 2 GiB checkpoint archived). botocore signs S3
    payloads only over plain HTTP; over HTTPS, TLS protects the body (and the archive checks
    every byte it downloads against its manifest's xxh3). obstore signs everywhere by default:
    unbroken sets ``unsigned_payload`` as botocore would, and s3fs's
    ``config_kwargs.s3.payload_signing_enabled`` or ``AWS_UNSIGNED_PAYLOAD`` decide when given."""
    creds = {"key": "a", "secret": "b"}

    def unsigned(so: dict[str, Any]) -> Any:
        r = route_of("s3://b/p", so)
        assert r.kind == "obstore", r
        return r.config.get("unsigned_payload")

    assert unsigned(creds) is True  # AWS's own endpoint: https
    assert unsigned({**creds, "endpoint_url": "https://s3.example.com"}) is True
    assert unsigned({**creds, "endpoint_url": "http://127.0.0.1:9000"}) is None  # signed
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert unsigned(creds) is None
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3 = {"s3": {"payload_signing_enabled": True, "addressing_style": "path"}}
    assert unsigned({**creds, "config_kwargs": s3}) is False
    s3 = {"s3": {"payload_signing_enabled": False}}
    assert unsigned({**creds, "endpoint_url": "http://h:1", "config_kwargs": s3}) is True
    assert unsigned({"anon": True}) is None  # nothing is signed at all
    monkeypatch.setenv("AWS_UNSIGNED_PAYLOAD", "false")
    assert unsigned(creds) is None  # obstore reads the environment itself
    with pytest.raises(ValueError, match=r"payload_signing_enabled='no' must be True or False"):
        route_of("s3://b", {**creds, "config_kwargs": {"s3": {"payload_signing_enabled": "no"}}})


def test_options_obstore_lacks_send_the_url_to_fsspec_and_say_which() -> None:
    """issue 22 item 1: what users already pass keeps working: an unknown key -> fsspec."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"profile": "dev"}, "profile"),
        ({"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}}, "s3_additional_kwargs"),
        ({"client_kwargs": {"verify": False}}, "client_kwargs.verify"),
        ({"config_kwargs": {"signature_version": "s3v4"}}, "config_kwargs.signature_version"),
    ]
    for so, key in cases:
        r = route_of("s3://b/p", so)
        assert r.kind == "fsspec" and key in r.why, (so, r)
    assert route_of("memory://x").kind == "fsspec"
    assert route_of("/local/dir").kind == "fsspec"
    assert route_of("file:///x").kind == "fsspec"
    assert route_of("hf://datasets/x").kind == "fsspec"
    assert route_of("s3://b", options=StoreOptions(client="fsspec")).kind == "fsspec"
    with pytest.raises(ValueError, match=r"client='obstore'\) but obstore cannot serve it"):
        route_of("s3://b", {"profile": "p"}, StoreOptions(client="obstore"))


def test_botocore_profiles_go_to_fsspec_unless_keys_are_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """issue 22 item 1: obstore does not read ~/.aws; a profile-only setup stays on s3fs."""
    monkeypatch.setenv("AWS_PROFILE", "dev")
    assert route_of("s3://b").kind == "fsspec"
    assert route_of("s3://b", {"key": "a", "secret": "b"}).kind == "obstore"
    monkeypatch.delenv("AWS_PROFILE")
    creds = tmp_path / "credentials"
    creds.write_text("[default]\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    assert "credentials come from" in route_of("s3://b").why
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    assert route_of("s3://b").kind == "obstore"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    creds.unlink()
    assert route_of("s3://b").kind == "obstore"  # instance / web-identity credentials


def test_gcs_azure_http_mapping(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sa = tmp_path / "sa.json"
    sa.write_text("{}")
    assert route_of("gs://b/x", {"token": str(sa), "project": "p"}).config == {
        "service_account": str(sa)
    }
    assert route_of("gs://b", {"token": "anon"}).config == {"skip_signature": True}
    assert route_of("gs://b", {"token": "google_default"}).kind == "fsspec"
    assert "allow_http" not in route_of("gs://b", {"token": str(sa)}).client
    emu = tmp_path / "emulator.json"  # object_store's test credentials: a local endpoint
    emu.write_text('{"gcs_base_url": "http://127.0.0.1:4443", "disable_oauth": true}')
    assert route_of("gs://b", {"token": str(emu)}).client["allow_http"] is True
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(emu))
    assert route_of("gs://b").client["allow_http"] is True
    emu.write_bytes(b"\xff not json")  # obstore's to report, not ours to crash on
    assert "allow_http" not in route_of("gs://b").client
    az = route_of("az://c/x", {"account_name": "acc", "account_key": "k", "sas_token": "s"})
    assert az.config == {"account_name": "acc", "account_key": "k", "sas_key": "s"}
    assert route_of("az://c", {"connection_string": "x"}).kind == "fsspec"
    assert route_of("http://127.0.0.1:1/d").client["allow_http"] is True
    assert route_of("https://h/d").client["allow_http"] is False
    assert route_of("https://h/d", {"headers": {}}).kind == "fsspec"


def test_store_options_are_validated_by_name() -> None:
    with pytest.raises(ValueError, match="StoreOptions.part_bytes=1024 must be an integer >= "):
        StoreOptions(part_bytes=1024)
    with pytest.raises(ValueError, match="StoreOptions.client='boto'"):
        StoreOptions(client="boto")
    with pytest.raises(ValueError, match="StoreOptions.timeout=0"):
        StoreOptions(timeout=0)


def test_every_range_plan_covers_the_object_and_asks_one_byte_more() -> None:
    for size in (1, 5, 7, 8, 9, 100):
        p = parts(size, 4)
        assert p[0][0] == 0 and p[-1][1] == size + 1
        assert all(a[1] == b[0] for a, b in zip(p, p[1:], strict=False))


def test_errors_survive_pickling_with_their_url() -> None:
    e = pickle.loads(pickle.dumps(ObjectMismatch("s3://b/k", "shorter")))
    assert (e.url, e.reason, str(e)) == ("s3://b/k", "shorter", "s3://b/k: shorter")
    r = pickle.loads(pickle.dumps(RemoteStorageError("s3://b/k: down", url="s3://b/k")))
    assert r.url == "s3://b/k" and str(r) == "s3://b/k: down"


def test_a_bad_obstore_configuration_is_refused_naming_the_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_SKIP_SIGNATURE", "maybe")  # what obstore reads and rejects
    with pytest.raises(ValueError, match="s3://b/x: cannot configure obstore.*maybe"):
        open_store("s3://b/x", {"key": "AK", "secret": "SK"})


@pytest.mark.parametrize(
    ("so", "named"),
    [
        ({"client_kwargs": {"endpoint_url": 5}}, "storage_options.client_kwargs.endpoint_url=5"),
        ({"endpoint_url": ["http://h"]}, "storage_options.endpoint_url=['http://h']"),
        ({"client_kwargs": {"region_name": 5}}, "storage_options.client_kwargs.region_name=5"),
        ({"config_kwargs": {"connect_timeout": -5}}, "config_kwargs.connect_timeout=-5"),
        ({"config_kwargs": {"read_timeout": "abc"}}, "config_kwargs.read_timeout='abc'"),
        ({"config_kwargs": {"retries": {"max_attempts": -1}}}, "retries.max_attempts=-1"),
        ({"config_kwargs": {"retries": {"total_max_attempts": 0}}}, "total_max_attempts=0"),
        ({"config_kwargs": {"retries": {"max_attempts": "3"}}}, "retries.max_attempts='3'"),
    ],
)
def test_a_malformed_s3fs_option_is_refused_naming_it_and_its_value(
    so: dict[str, Any], named: str
) -> None:
    """A value of the wrong type or range is a ValueError naming the option and the value
    (before: an AttributeError from deep inside, a bare float() error, or a negative timeout
    reaching obstore as "'timedelta' object is not an instance of 'str'")."""
    with pytest.raises(ValueError, match=re.escape(named)):
        route_of("s3://b/p", {"key": "AK", "secret": "SK", **so})
