"""The fork server's abstract socket against a stranger on the node (README, "Security
model: a shared node"): anyone in the network namespace can connect to it. A real fork
server (``test_launch``'s fixtures) and real connections."""

from __future__ import annotations

import socket
import time

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


def test_peers_that_send_nothing_do_not_hold_up_a_launcher(tmp_path, server):  # noqa: F811
    """The server read one request at a time, up to 5 s each: three connections of this uid
    (a sidecar in another pid namespace passes ``SO_PEERCRED``, but holds no key) that sent
    nothing held a launcher up 15 s, and a peer reconnecting as fast as it was dropped
    stalled every restart of the job with no error. Requests are read side by side now:
    the launcher is served at once while they wait out their 5 s."""
    name, zpid, key = server
    idle = []
    for _ in range(8):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + name)
        idle.append(s)
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect("\0" + name)
    half.sendall(b"\0\0\1\0{")  # says 256 bytes, sends one
    idle.append(half)
    try:
        t0 = time.monotonic()
        _served_by_zygote(tmp_path, _zygote_env(name, zpid, key))
        took = time.monotonic() - t0
        assert took < 4.0, f"a launcher waited {took:.1f} s behind peers that sent nothing"
        for s in idle:  # each is refused once its 5 s are up, and the server serves on
            s.settimeout(20)
            assert b"refused" in s.recv(200)
    finally:
        for s in idle:
            s.close()
    assert is_alive(zpid)
    (tmp_path / "again").mkdir()
    _served_by_zygote(tmp_path / "again", _zygote_env(name, zpid, key))
