"""The node cache's download pool (``data/stream/remote/pool.py``): the unit needed soonest
runs first, a reader's demand moves a queued unit ahead, one task per unit at a time."""

from __future__ import annotations

import threading

from unbroken.data.stream.remote.pool import Pool


def _pool() -> tuple[Pool, list[int], threading.Event]:
    """A one-thread pool whose first task (unit 0) holds the thread until the event is set;
    every task records its unit in order."""
    ran: list[int] = []
    gate = threading.Event()

    def fetch(uid: int, prio: int) -> str:
        if uid == 0:
            gate.wait(30)
        ran.append(uid)
        return f"unit {uid}"

    pool = Pool(1, fetch, "test-pool")
    return pool, ran, gate


def test_the_unit_needed_soonest_runs_first_and_a_demand_moves_a_queued_one_ahead() -> None:
    pool, ran, gate = _pool()
    first = pool.submit(0, 0)
    queued = {uid: pool.submit(uid, prio) for uid, prio in ((1, 10), (2, 20), (3, 30))}
    assert pool.submit(2, 40) is queued[2]  # one task per unit; a later need changes nothing
    assert pool.submit(3, 5) is queued[3]  # needed sooner now (a reader waits for it)
    gate.set()
    assert [f.result(30) for f in (first, *queued.values())] == [f"unit {u}" for u in range(4)]
    assert ran == [0, 3, 1, 2]
    pool.stop(10)


def test_a_running_unit_is_not_queued_again_and_stop_cancels_the_queue() -> None:
    pool, ran, gate = _pool()
    first = pool.submit(0, 0)
    later = pool.submit(1, 10)
    while not first.running():  # the thread took unit 0 (polled: it starts at once)
        threading.Event().wait(0.01)
    assert pool.busy(0) and pool.submit(0, -1) is first
    threading.Thread(target=lambda: pool.stop(30)).start()
    while not pool.stopping:
        threading.Event().wait(0.01)
    gate.set()
    assert first.result(30) == "unit 0" and later.cancelled() and ran == [0]
