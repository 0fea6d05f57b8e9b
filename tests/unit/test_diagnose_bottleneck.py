"""Bottleneck report: stage arithmetic, measured stages with injected delays, a real dataset."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np
import pytest
import torch

from unbroken.data.diagnose.bench import basic_decode, bench_dataset, measure_stages
from unbroken.data.diagnose.bottleneck import BottleneckReport, StageResult, analyse, load_report

NAN = float("nan")


def stages(
    read: float = 10_000,
    decode: float = 500,
    collate: float = 50_000,
    transport: float = 8_000,
    pin: float = NAN,
    h2d: float = NAN,
) -> list[StageResult]:
    return [
        StageResult("shard read", "worker", read),
        StageResult("decode", "worker", decode),
        StageResult("collate", "worker", collate),
        StageResult("transport", "main", transport),
        StageResult("pin", "main", pin),
        StageResult("h2d", "device", h2d),
    ]


def test_worker_stages_add_up_and_scale_with_workers() -> None:
    r = analyse(stages(), batch_size=32, num_workers=2, consume_rate=5_000, cpu_count=32)
    per_worker = 1 / (1 / 10_000 + 1 / 500 + 1 / 50_000)
    assert r.worker_rate == pytest.approx(per_worker)
    assert r.pipeline_rate == pytest.approx(2 * per_worker)
    assert r.limiting == "decode" and r.bottleneck == "decode"
    # 20% headroom over the consumer: ceil(6000 / 471.7) = 13 workers
    assert r.suggested_workers == math.ceil(1.2 * 5_000 / per_worker) == 13
    assert "data-bound: decode limits" in r.format()


def test_workers_are_capped_by_cores_and_the_report_says_so() -> None:
    r = analyse(stages(), batch_size=32, num_workers=16, consume_rate=5_000, cpu_count=8)
    # 16 workers on 8 cores do not run 16 at a time
    assert r.pipeline_rate == pytest.approx(8 * r.worker_rate)
    assert r.suggested_workers == 7  # cores - 1
    assert any("even 7 workers" in a and "make decode cheaper" in a for a in r.advice)


def test_slow_consumer_means_no_data_stall() -> None:
    r = analyse(stages(), batch_size=32, num_workers=2, consume_rate=100, cpu_count=8)
    assert r.bottleneck == "no data stall"
    assert r.limiting == "decode"  # what would limit first
    assert r.suggested_workers == 1


def test_main_side_stages_limit_regardless_of_workers() -> None:
    r = analyse(
        stages(decode=100_000, transport=900),
        batch_size=64,
        num_workers=4,
        consume_rate=2_000,
        cpu_count=8,
    )
    assert r.bottleneck == "transport"
    assert any("shared memory" in a for a in r.advice)
    r = analyse(
        stages(decode=100_000, pin=20_000, h2d=1_500),
        batch_size=64,
        num_workers=4,
        consume_rate=2_000,
        cpu_count=8,
    )
    assert r.bottleneck == "h2d" and any("uint8" in a for a in r.advice)


def test_num_workers_zero_runs_worker_stages_in_process_without_transport() -> None:
    r = analyse(stages(transport=10.0), batch_size=8, num_workers=0, consume_rate=100, cpu_count=4)
    assert r.pipeline_rate == pytest.approx(r.worker_rate)  # transport ignored, 1 "worker"
    assert r.bottleneck == "no data stall"


def test_without_a_consumer_rate_the_capacity_is_reported() -> None:
    r = analyse(stages(), batch_size=32, num_workers=2, cpu_count=8)
    assert r.bottleneck == "decode" and "give the model's rate" in r.advice[0]


def test_prefetch_factor_follows_worker_jitter() -> None:
    steady = np.full(40, 10.0)
    jittery = np.r_[np.full(36, 10.0), np.full(4, 35.0)]
    assert (
        analyse(
            stages(), batch_size=8, num_workers=2, cpu_count=4, worker_batch_ms=steady
        ).suggested_prefetch_factor
        == 2
    )
    assert (
        analyse(
            stages(), batch_size=8, num_workers=2, cpu_count=4, worker_batch_ms=jittery
        ).suggested_prefetch_factor
        == 5
    )


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="consume_rate=0"):
        analyse(stages(), batch_size=8, num_workers=2, consume_rate=0)
    with pytest.raises(ValueError, match="no stage was measured"):
        analyse([StageResult("pin", "main", NAN)], batch_size=8, num_workers=2)
    with pytest.raises(ValueError, match="num_batches=1"):
        measure_stages(lambda b: [], batch_size=1, num_batches=1)


def slow_decode(sample: dict[str, Any]) -> torch.Tensor:
    time.sleep(0.002)  # 2 ms per sample: ~500 samples/s per worker
    return torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8).float()


def fast_read(b: int) -> list[dict[str, Any]]:
    return [{"bin": bytes(64)} for _ in range(8)]


def test_measured_slow_decode_is_named_and_a_slow_consumer_is_not_stalled(tmp_path: Any) -> None:
    measured, worker_ms = measure_stages(
        fast_read, batch_size=8, num_batches=6, decode=slow_decode, max_seconds=6.0
    )
    by = {s.name: s for s in measured}
    assert [s.name for s in measured] == [
        "shard read",
        "decode",
        "collate",
        "transport",
        "pin",
        "h2d",
    ]
    assert 150 < by["decode"].samples_per_s < 520  # sleep is a floor, never faster
    assert by["shard read"].samples_per_s > 10 * by["decode"].samples_per_s
    assert by["transport"].samples_per_s > by["decode"].samples_per_s
    assert "shared-memory ring" in by["transport"].note  # tensor batches take the ring too
    assert by["shard read"].mb_per_s > 0
    if not torch.cuda.is_available():
        assert math.isnan(by["pin"].samples_per_s) and by["h2d"].note == "no CUDA device"
    assert worker_ms.shape == (5,) and np.all(worker_ms >= 16.0)  # first batch: warm-up

    fast_model = analyse(
        measured,
        batch_size=8,
        num_workers=2,
        consume_rate=5_000,
        cpu_count=4,
        worker_batch_ms=worker_ms,
    )
    assert fast_model.bottleneck == "decode"
    slow_model = analyse(
        measured,
        batch_size=8,
        num_workers=2,
        consume_rate=20,
        cpu_count=4,
        worker_batch_ms=worker_ms,
    )
    assert slow_model.bottleneck == "no data stall"

    # the JSON written for `data report` reads back to the same report
    path = tmp_path / "data_bench.json"
    path.write_text(json.dumps(fast_model.to_json()))
    back = load_report(str(tmp_path))
    assert isinstance(back, BottleneckReport)
    assert back.bottleneck == "decode"
    assert back.stage("decode").samples_per_s == by["decode"].samples_per_s
    assert math.isnan(back.stage("pin").samples_per_s)
    assert back.format() == fast_model.format()
    m = fast_model.metrics()
    assert m["bench/decode_samples_per_s"] == by["decode"].samples_per_s
    assert "bench/pin_samples_per_s" not in m


def test_basic_decode_by_extension() -> None:
    import io

    buf = io.BytesIO()
    np.save(buf, np.arange(3))
    s = {
        "__key__": "k",
        "json": b'{"a": 1}',
        "txt": "hé".encode(),
        "cls": b"7",
        "npy": buf.getvalue(),
        "bin": b"\x00\x01",
    }
    out = basic_decode(s)
    assert out["json"] == {"a": 1} and out["txt"] == "hé" and out["cls"] == 7
    assert out["npy"].tolist() == [0, 1, 2] and out["bin"] == b"\x00\x01"
    assert out["__key__"] == "k"
    arr = np.arange(4)
    assert basic_decode(arr) is arr  # token samples pass through


def test_bench_on_a_real_tar_dataset(stream_data: Any) -> None:
    r = bench_dataset(
        stream_data("tar"),
        batch_size=8,
        num_workers=1,
        consume_rate=1e9,
        num_batches=10,
        max_seconds=6.0,
    )
    names = [s.name for s in r.stages]
    assert names[:4] == ["shard read", "decode", "collate", "transport"]
    assert r.stage("shard read").samples_per_s > 0 and r.stage("shard read").mb_per_s > 0
    assert r.stage("decode").note == "basic_decode"
    assert r.bottleneck in ("shard read", "decode", "collate", "transport")
    assert "suggest: num_workers=" in r.format()


def test_bench_on_token_shards_and_too_big_a_batch(stream_data: Any) -> None:
    r = bench_dataset(
        stream_data("tokens"),
        batch_size=4,
        num_workers=2,
        consume_rate=10.0,
        num_batches=5,
        max_seconds=4.0,
        transform=None,
    )
    assert r.bottleneck == "no data stall"
    assert math.isinf(r.stage("decode").samples_per_s)  # no transform: nothing to time
    with pytest.raises(ValueError, match="smaller --batch-size"):
        bench_dataset(stream_data("tokens"), batch_size=10_000)


def test_transport_of_byte_batches_is_measured_through_the_loaders_ring() -> None:
    """The bench measures the transport StatefulLoader uses: the shared-memory ring."""
    from unbroken.data.stream.transport import transport_available

    measured, _ = measure_stages(
        fast_read, batch_size=8, num_batches=2, collate=list, max_seconds=2.0
    )
    note = {s.name: s for s in measured}["transport"].note
    assert ("shared-memory ring" if transport_available() else "torch's pipe") in note
