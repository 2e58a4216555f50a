"""Real network faults on the namespace test bed (`network_testbed.py`): hosts are network
namespaces on a bridge, so a cut link makes packets vanish instead of refusing them. Needs root
and `ip netns` (CI has both); skipped with the reason elsewhere. The run with a host cut during a
step is `slow` (`-m slow`); the other faults (save, brown-out, freeze, kill) are measured by
`python -m bench.network_faults`."""
import json
import socket
import time

import pytest

from ftrain.distributed.comms import refuses_connections
from ftrain.testbeds.network_testbed import TestBed, available

from conftest import run_bench

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"namespace test bed: {REASON}")


@pytest.fixture
def testbed():
    with TestBed(2, prefix="ftnett", subnet="10.78.0") as bed:
        yield bed


def test_a_cut_link_drops_packets_without_refusing_and_heals(testbed):
    """Host 0 reaches a listener on host 1; cut, a connect gets no answer at all (neither a
    connection nor a refusal, as with a real dead link), and after healing it connects again.
    A brown-out relay delays each frame both ways."""
    with testbed.enter(1):
        listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
    peer = (testbed.hosts[1].ip, port)
    with testbed.enter(0):
        socket.create_connection(peer, timeout=2).close()
        testbed.cut(1)
        with pytest.raises(socket.timeout):
            socket.create_connection(peer, timeout=0.5)
        assert not refuses_connections(peer)
        testbed.heal(1)
        socket.create_connection(peer, timeout=2).close()
        testbed.brownout(1, delay_s=0.1, loss=0.0)
        time.sleep(0.5)  # the relay process starts
        t0 = time.monotonic()
        socket.create_connection(peer, timeout=5).close()  # SYN and SYN-ACK each 0.1 s late
        assert time.monotonic() - t0 >= 0.2
    listener.close()


@pytest.mark.slow  # ~3 min on 2 cores: three Ray nodes, two runs, c10d's first connects wait on DNS
def test_a_host_cut_during_a_step_is_unreachable_found_in_time_and_costed_right(tmp_path):
    """Three hosts (driver on one, a worker and a spare on each of the others); rank 1's host is
    cut during step 3. The cut is found within the step deadline + 1 s and labelled
    'unreachable', the run finishes with the losses of a run without fault, bitwise, and the
    timeline's total_s is within 10 % of the stall measured by the wall clock. The machine's
    hostname resolves to 127.0.0.1 inside the test bed here, so this also runs gloo across
    hosts whose hostname is loopback."""
    out = tmp_path / "rows.json"
    run_bench("network_faults", "--faults", "cut_step", "--out", str(out))
    (row,) = json.loads(out.read_text())
    assert row["kind"] == "unreachable" and row["losses_equal"], row
    assert row["detect_s"] <= row["step_deadline_s"] + 1.0, row
    assert abs(row["total_s"] - row["stall_s"]) <= 0.1 * row["stall_s"], row
