"""torchrun's agent stops its workers in ``LocalElasticAgent._shutdown`` (``PContext.close``:
signal them, wait, then stop the threads that copy their logs). A stop signal that arrives
meanwhile raises torchrun's ``SignalException`` out of the middle of it: the log threads are
never stopped, and the agent hangs at exit joining them, for good. Seen when a supervisor
was killed outright: its agent, shutting down after losing the rendezvous store, got the
SIGTERM that ``PR_SET_PDEATHSIG`` sends (2 of 24 runs under load). The agents ``unbroken
run`` starts (launch/agent.py) finish that shutdown with stop signals ignored."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api as mp_api

from unbroken.elastic.launch.agent import shutdown_uninterrupted


class _Workers:
    """A process context whose close() is signalled half-way, as a SIGTERM can land."""

    def __init__(self) -> None:
        self.finished = False

    def close(self, death_sig: Any, timeout: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered before the next bytecode
        for _ in range(1000):  # a few more bytecodes: time for the handler to run
            pass
        self.finished = True  # what torchrun does last: stop the log threads


def _agent() -> Any:
    agent = LocalElasticAgent.__new__(LocalElasticAgent)  # only what _shutdown reads
    agent._worker_watchdog = agent._health_check_server = None
    agent._pcontext = _Workers()  # type: ignore[assignment]
    return agent


@pytest.fixture
def torchruns_handler():
    old = signal.signal(signal.SIGTERM, mp_api._terminate_process_handler)
    own = LocalElasticAgent._shutdown
    yield
    signal.signal(signal.SIGTERM, old)
    LocalElasticAgent._shutdown = own  # type: ignore[method-assign]


def test_torchruns_own_shutdown_is_cut_short_by_a_sigterm(torchruns_handler):
    agent = _agent()
    with pytest.raises(mp_api.SignalException):
        agent._shutdown(signal.SIGTERM, 30)
    assert not agent._pcontext.finished  # the defect this guards against, in torch as it is


def test_the_guarded_shutdown_finishes_and_the_signal_handler_comes_back(torchruns_handler):
    assert shutdown_uninterrupted()
    assert shutdown_uninterrupted()  # idempotent: wrapped once
    agent = _agent()
    agent._shutdown(signal.SIGTERM, 30)
    assert agent._pcontext.finished
    assert signal.getsignal(signal.SIGTERM) is mp_api._terminate_process_handler
    with pytest.raises(mp_api.SignalException):  # a stop signal after it acts as before
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
