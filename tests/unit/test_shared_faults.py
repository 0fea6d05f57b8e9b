"""A failure caused by a stranger's write to the rendezvous store says so (README, "Security
model: a shared node"): torchrun's console of an agent that refused a planted state."""

from __future__ import annotations

from unbroken.elastic.faults import Action, Evidence, FaultClass, classify

CONSOLE = """\
W1203 16:23:10.690000 31089 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] The node 'localhost_31089_0' has failed to shutdown the rendezvous 'unbroken-g1' due to an error of type RendezvousStateError.
Traceback (most recent call last):
  File "/x/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line 444, in sync
    self._state = pickle.loads(state_bits)
_pickle.UnpicklingError: the rendezvous state read from the store is refused (it names the global posix.system): anyone who reaches the store can write it; keep --rdzv-endpoint on a trusted network \x1b[2J

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 936, in main
torch.distributed.elastic.rendezvous.api.RendezvousStateError: The rendezvous state is corrupt. See inner exception for details.
"""


def test_a_refused_rendezvous_state_is_named_in_the_failure():
    """It was filed as ``rendezvous: torchrun failed (no worker failure reported)``, a lost
    node: nothing said that someone had written the store."""
    c = classify(Evidence("exit", 1, (), CONSOLE))
    assert c.fault is FaultClass.PROCESS and c.action is Action.RESTART
    assert c.rule == "rendezvous_state"
    assert "the rendezvous state read from the store is refused" in c.reason
    assert "posix.system" in c.reason and "\x1b" not in c.reason
