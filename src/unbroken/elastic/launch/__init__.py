"""How an attempt's processes start: the torchrun agent and its workers.

``attempt``      one attempt: a torchrun agent and everything it starts
``standby``      the next attempt's agent, started ahead with torch imported
``agent``        torchrun with rank 0's ``MASTER_PORT`` held (the standby's, and the fresh agent)
``forkserver``   the standby's fork server: forks the workers, pre-warmed
``worker``       the per-rank launcher torchrun starts (standard library only, run by path)

This package imports nothing: ``python -m unbroken.elastic.launch.standby`` (or ``.agent``) and
the launcher start without it.
"""
