"""One answer to "is this a remote URL" for the whole package (common.fs)."""

from __future__ import annotations

import fsspec
import pytest

from unbroken.ckpt.store import Store
from unbroken.common.fs import is_local_fs, is_remote, local_path


@pytest.mark.parametrize(
    ("url", "remote"),
    [
        ("s3://bucket/ckpt", True),
        ("gs://b/x", True),
        ("memory://x", True),
        ("file:///mnt/nfs/x", False),
        ("/mnt/nfs/x", False),
        ("relative/dir", False),
        ("C:dir", False),
    ],
)
def test_is_remote(url: str, remote: bool) -> None:
    assert is_remote(url) is remote


def test_local_path_and_local_fs(tmp_path) -> None:
    assert local_path("file:///mnt/x") == "/mnt/x" and local_path("/mnt/x") == "/mnt/x"
    assert is_local_fs(fsspec.core.url_to_fs(f"file://{tmp_path}")[0])
    assert is_local_fs(fsspec.core.url_to_fs(str(tmp_path))[0])
    assert not is_local_fs(fsspec.core.url_to_fs("memory://x")[0])


def test_callers_agree(tmp_path) -> None:
    # a file:// checkpoint root is a local directory; a remote one is refused with the fix
    assert Store(f"file://{tmp_path}").root == str(tmp_path)
    with pytest.raises(ValueError, match="archive='s3://...'"):
        Store("s3://bucket/ckpt")
