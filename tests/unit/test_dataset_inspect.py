"""Shuffle-quality statistics and `unbroken data inspect`."""

from __future__ import annotations

import json
from typing import cast

import pytest

from unbroken.cli import main
from unbroken.data.diagnose.shuffle import shuffle_stats
from unbroken.data.stream.dataset import StreamingDataset


def test_statistics_tell_a_shuffle_from_none(stream_data):
    root = stream_data("tar")
    plain = StreamingDataset(root, shuffle=False)
    none = shuffle_stats(plain, epochs=2)
    shards = plain._readers[0].counts.size
    assert none[0].spearman == pytest.approx(1.0)
    assert none[0].displacement == 0.0 and none[0].vs_random == 0.0
    assert none[0].same_shard == pytest.approx(1 - (shards - 1) / 202)  # shard by shard
    assert none[1].prev_epoch == pytest.approx(1.0)  # every epoch the same
    # a window of ~4 shards: about a quarter of consecutive pairs share a shard
    good = shuffle_stats(StreamingDataset(root, seed=3, shuffle_window=16), epochs=3)
    for s in good:
        assert abs(s.spearman) < 0.35 and s.vs_random > 0.6
        assert s.same_shard_random < s.same_shard < 0.45
    assert good[0].prev_epoch is None and abs(cast(float, good[1].prev_epoch)) < 0.35
    assert len({s.first_shards for s in good}) == 3  # the shard order changes every epoch
    # a smaller window mixes fewer shards: more consecutive pairs from one shard
    narrow = shuffle_stats(StreamingDataset(root, seed=3, shuffle_window=4), epochs=1)[0]
    assert narrow.same_shard > good[0].same_shard
    # the default window covers this small dataset: a global shuffle
    full = shuffle_stats(StreamingDataset(root, seed=3), epochs=1)[0]
    assert full.same_shard < 3 * full.same_shard_random + 0.02 and abs(full.spearman) < 0.2


def test_cli_data_inspect_prints_a_row_per_epoch(stream_data, capsys):
    root = stream_data("tokens")
    assert main(["data", "inspect", root, "--seed", "1", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens dataset" in out and "seed 1" in out
    rows = [ln for ln in out.splitlines() if ln[:1].isdigit()]
    assert [r.split()[0] for r in rows] == ["0", "1"]
    assert main(["data", "inspect", root, "--epochs", "1", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["epoch"] == 0 and rec["samples"] == StreamingDataset(root).epoch_length
    assert main(["data", "inspect", root + "/missing"]) == 2
    assert "no dataset manifest" in capsys.readouterr().err
