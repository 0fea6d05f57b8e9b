"""The supervisors' rendezvous store against a stranger who deletes keys (README, "Security
model: a shared node"): a ``get`` of a missing key waits for it until the store's timeout
(``--join-timeout``, 600 s by default). Real TCPStores on 127.0.0.1."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from unbroken.elastic.rendezvous import Coordinator

pytestmark = pytest.mark.timeout(60)


def test_keys_a_stranger_deleted_block_no_read():
    """Seen: another user deleted ``unbroken/<run id>/gen`` and the supervisor's watch loop
    sat in ``get`` for the join timeout (600 s): a worker SIGKILLed meanwhile was not
    restarted, no hang was detected, a SIGTERM not acted on; deleting it again froze it
    again. Every read now answers at once: the last good generation, no stop, no peers."""
    coord = Coordinator("127.0.0.1", 0, "job", "a", connect_timeout=8.0)
    stranger = TCPStore("127.0.0.1", coord.port, is_master=False, timeout=timedelta(seconds=8))
    assert coord.bump(0) == 1
    coord.set_stop(3, "the same failure twice")
    stranger.append("unbroken/job/nodes", "b\n")  # type: ignore[attr-defined]
    stranger.set("unbroken/job/alive/b", repr(time.time()))
    for key in ("gen", "stop", "nodes", "alive/a", "alive/b"):
        assert stranger.delete_key("unbroken/job/" + key), key
    t0 = time.monotonic()
    assert coord.gen() == 1  # the last good generation
    assert coord.get_stop() is None
    assert coord.peers() == {}
    assert coord.wait_peers_done(timeout=5.0, silent_after=5.0) == []
    took = time.monotonic() - t0
    assert took < 2.0, f"reads of deleted keys took {took:.1f} s"
    assert coord.bump(1) == 2  # and a restart still moves on
    assert not stranger.check(["unbroken/job/stop"]), "a read wrote the key back"
