"""`unbroken run` against a stranger on the node who reaches the rendezvous store (README,
"Security model: a shared node"). The store has no authentication and listens on
127.0.0.1 by default, which every user of the node can reach; torchrun's own rendezvous
state lives in it as a pickle (``torch.rendezvous.<run id>-g<gen>``). Real supervisors,
torchrun agents and workers on 127.0.0.1; the stranger is a plain TCPStore client."""

from __future__ import annotations

import base64
import os
import pickle
from datetime import timedelta

import elastic_harness as h
import pytest
from torch.distributed import TCPStore

pytestmark = pytest.mark.timeout(240)


class _Plant:
    """What a stranger writes into torchrun's rendezvous key: unpickling it makes a
    directory (any callable would do; os.mkdir leaves a trace and returns None)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (self.marker,)


def test_a_pickle_planted_in_torchruns_rendezvous_key_runs_no_code(tmp_path):
    """torchrun's agent reads its rendezvous state back from the store with
    ``pickle.loads`` (every sync: joins, keep-alives, each membership poll), so whoever
    reached the store ran code as the job's user in its agent: seen as another uid on the
    node writing ``torch.rendezvous.unbroken-g0``, its payload run as the job's uid within a
    second. The agents ``unbroken run`` starts accept a state of torchrun's own types only:
    a planted one is refused (the attempt fails and restarts on a fresh key) and the job
    runs to its end."""
    marker = str(tmp_path / "stranger-ran-code")
    stop = str(tmp_path / "stop")
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"), [], h.script_args(tmp_path, 10_000, sleep=0.05, stop_file=stop)
        )
        h.wait_until(lambda: h.live_beats(job, 0, 3, ranks=1), 90, "step 3", job)
        (ev,) = job.events("start")
        host, _, port = ev["store"].rpartition(":")
        stranger = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        gen = int(stranger.get("unbroken/unbroken/gen"))
        stranger.set(
            f"torch.rendezvous.unbroken-g{gen}",
            base64.b64encode(pickle.dumps(_Plant(marker))).decode(),
        )
        # The agent syncs the state at least once a second (torchrun's membership poll).
        h.wait_until(
            lambda: os.path.exists(marker) or job.events("failure"), 60, "the state read", job
        )
        h.wait_until(lambda: h.live_beats(job, 1, 1, ranks=1), 90, "the restart trains", job)
        open(stop, "w").close()
        assert job.wait(120) == 0, job.output()[-3000:]
    assert not os.path.exists(marker), "the stranger's pickle ran in the job's agent"
    reasons = [f["reason"] for f in job.events("failure")]
    assert any("rendezvous state read from the store is refused" in r for r in reasons), reasons
