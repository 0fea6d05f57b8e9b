"""Shared fixtures. The data builders live in ``tests/datakit.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from datakit import build_tar_dataset, build_token_dataset


@pytest.fixture(scope="session")
def stream_data(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``stream_data(name)`` -> a dataset directory, built once per session:
    ``tar`` (203 samples in ~55 shards of 2-4), ``tar_b`` (61 samples, keys ``b*``),
    ``tokens`` (seq_len 8, ~120 sequences in 5 shards)."""
    base = tmp_path_factory.mktemp("stream-data")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            out = str(base / name)
            if name == "tar":
                build_tar_dataset(out, 203)
            elif name == "tar_b":
                build_tar_dataset(out, 61, prefix="b")
            elif name == "tokens":
                build_token_dataset(out, 5, 200, seq_len=8)
            else:
                raise KeyError(name)
            built[name] = out
        return built[name]

    return get
