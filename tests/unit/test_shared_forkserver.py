"""The fork server's abstract socket against a stranger on the node (README, "Security
model: a shared node"): anyone in the network namespace can connect to it. A real fork
server (``test_launch``'s fixtures) and real connections."""

from __future__ import annotations

import socket

from test_launch import _served_by_zygote, _zygote_env, agent, server  # noqa: F401 - fixtures

from unbroken.common.procs import is_alive


def test_a_connection_flood_does_not_fill_the_log(tmp_path, server):  # noqa: F811
    """Each refused connection wrote one line to ``zygote.log`` in the run directory: a
    process of another uid connected 70,000 times in 5 s and wrote 4.8 MB (a disk filled
    at ~1 MB/s per process). Refusals of peers without the key are logged once a minute,
    with how many were not; the server still serves its launchers."""
    name, zpid, key = server
    for _ in range(2000):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\0" + name)
            s.sendall(b"\0\0\0\x05hello")
    _served_by_zygote(tmp_path, _zygote_env(name, zpid, key))  # after the flood: answered
    assert is_alive(zpid)
    lines = (tmp_path / "zygote.log").read_text().splitlines()
    refused = [line for line in lines if "refused a request" in line]
    assert 1 <= len(refused) <= 2, lines[:5]
