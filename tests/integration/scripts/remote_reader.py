"""One rank reading a remote dataset through the node cache, for tests/integration.

Usage: ``python remote_reader.py CONFIG.json``. The config names the dataset URL, the S3
endpoint, the cache, this rank, the loader layout and an output file. One JSON line per
delivered batch: ``{"epoch": e, "keys": [...], "state": loader.state_dict()}`` (flushed, so a
test can kill the process at any time and resume from the last line's state, given as
``"resume"`` in the config). ``"hold_at": n`` stops after the n-th line and waits to be
killed (so a test kills every rank at a known point, however unevenly the box runs them).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from unbroken.data import CacheConfig, StatefulLoader, StreamingDataset


def keys(batch: list[dict[str, object]]) -> list[str]:
    return [str(s["__key__"]) for s in batch]


def main() -> int:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    opts = {
        "client_kwargs": {"endpoint_url": cfg["endpoint"]},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    ds = StreamingDataset(
        cfg["url"],
        seed=cfg["seed"],
        shuffle_window=cfg["window"],
        rank=cfg["rank"],
        world_size=cfg["world_size"],
        cache=CacheConfig(
            cache_dir=cfg["cache_dir"],
            cache_limit=cfg["limit"],
            storage_options=opts,
            prefetch_shards=cfg["prefetch"],
            timeout=20,
            backoff_s=0.05,
        ),
    )
    loader = StatefulLoader(
        ds, batch_size=cfg["batch"], num_workers=cfg["workers"], collate_fn=keys
    )
    if cfg.get("resume") is not None:
        loader.load_state_dict(cfg["resume"])
    written = 0
    with open(cfg["out"], "a") as out:
        while loader.epoch < cfg["epochs"]:
            epoch = loader.epoch
            loader.set_epoch(epoch)
            for batch in loader:
                out.write(
                    json.dumps({"epoch": epoch, "keys": batch, "state": loader.state_dict()}) + "\n"
                )
                out.flush()
                written += 1
                while written == cfg.get("hold_at"):  # until the test kills this process
                    signal.pause()
    os.close(os.open(cfg["out"] + ".done", os.O_CREAT | os.O_WRONLY, 0o644))
    return 0


if __name__ == "__main__":
    sys.exit(main())
