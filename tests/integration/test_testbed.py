"""The namespace testbed (benchmarks/testbed.py): namespaces, links and limits appear, traffic flows only
between them, and everything is removed again: on normal exit, on an error, and on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.testbed import Testbed, list_namespaces, missing_requirements

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(missing_requirements() is not None,
                                 reason=f"testbed unavailable: {missing_requirements()}")]

SERVER = "import socket; s = socket.create_server(('{ip}', 9000)); c, _ = s.accept(); c.sendall(b'pong')"
CLIENT = ("import socket, time\n"
          "for _ in range(100):\n"
          "    try:\n"
          "        c = socket.create_connection(('{ip}', 9000), timeout=2); break\n"
          "    except OSError: time.sleep(0.05)\n"
          "print(c.recv(4).decode())")


def _qdiscs(ns: str, dev: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                          capture_output=True, text=True, check=True).stdout


def test_namespaces_link_shape_and_disappear(tmp_path: Path) -> None:
    prefix = f"pdt{os.getpid()}"
    with Testbed(hosts=2, rate_mbit=50, prefix=prefix) as bed:
        assert sorted(list_namespaces(prefix)) == sorted([bed.bridge_ns, bed.ns(0), bed.ns(1)])
        assert "tbf" in _qdiscs(bed.ns(0), "eth0") and "rate 50Mbit" in _qdiscs(bed.ns(0), "eth0")
        assert "tbf" in _qdiscs(bed.bridge_ns, "h1")
        # TCP between two namespaces, on the testbed's own addresses.
        server = bed.popen(0, [sys.executable, "-c", SERVER.format(ip=bed.ip(0))])
        client = bed.popen(1, [sys.executable, "-c", CLIENT.format(ip=bed.ip(0))], stdout=subprocess.PIPE,
                           text=True)
        out, _ = client.communicate(timeout=30)
        assert out.strip() == "pong"
        server.wait(timeout=10)
    assert list_namespaces(prefix) == []

    # An error inside the block still removes everything.
    with pytest.raises(RuntimeError, match="boom"), Testbed(hosts=1, rate_mbit=10, prefix=prefix):
        assert len(list_namespaces(prefix)) == 2
        raise RuntimeError("boom")
    assert list_namespaces(prefix) == []


def test_sigterm_tears_the_testbed_down(tmp_path: Path) -> None:
    prefix = f"pds{os.getpid()}"
    script = ("import sys, time\n"
              "from benchmarks.testbed import Testbed, install_signal_teardown\n"
              "install_signal_teardown()\n"
              f"with Testbed(hosts=2, rate_mbit=10, prefix='{prefix}') as bed:\n"
              "    print('up', flush=True)\n"
              "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    try:
        assert proc.stdout.readline().strip() == "up"
        assert len(list_namespaces(prefix)) == 3
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while list_namespaces(prefix) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list_namespaces(prefix) == []


def _interpreter_for_nobody() -> str | None:
    """A Python that user 'nobody' can start: this one, else the system's (testbed.py needs only stdlib)."""
    for candidate in (sys.executable, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if candidate and subprocess.run([*NOBODY, candidate, "-c", "pass"], capture_output=True,
                                        timeout=30).returncode == 0:
            return candidate
    return None


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_cli_without_root_explains_and_exits() -> None:
    # The requirement check is what a non-root user hits first; run it as 'nobody' where possible. The
    # script runs from a world-readable copy, so the checkout may lie anywhere, with any permissions.
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the CLI as user 'nobody'")
    python = _interpreter_for_nobody()
    if python is None:
        pytest.skip("no Python interpreter that user 'nobody' may run")
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        script = Path(folder) / "testbed.py"
        shutil.copyfile(REPO_ROOT / "benchmarks" / "testbed.py", script)
        os.chmod(script, 0o644)
        proc = subprocess.run([*NOBODY, python, str(script), "--peers", "1"], cwd=folder, capture_output=True,
                              text=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "need root" in proc.stderr and "Traceback" not in proc.stderr


SERVE = ("import socket\n"
         "s = socket.create_server(('0.0.0.0', {port}))\n"
         "print('listening', flush=True)\n"
         "c, peer = s.accept(); c.sendall(peer[0].encode())")
DIAL = ("import socket\n"
        "try:\n"
        "    c = socket.create_connection(('{ip}', {port}), timeout=3); print(c.recv(64).decode())\n"
        "except OSError as e:\n"
        "    print('failed', type(e).__name__)")


def _dial(bed: Testbed, server: int, client: int, ip: str, port: int) -> str:
    """Start a one-shot TCP server in host ``server``, dial it from host ``client``: what the server saw as
    the client's address, or 'failed ...'."""
    srv = bed.popen(server, [sys.executable, "-c", SERVE.format(port=port)], stdout=subprocess.PIPE, text=True)
    assert srv.stdout.readline().strip() == "listening"
    cli = bed.popen(client, [sys.executable, "-c", DIAL.format(ip=ip, port=port)], stdout=subprocess.PIPE,
                    text=True)
    out, _ = cli.communicate(timeout=30)
    srv.kill()
    return out.strip()


@pytest.mark.skipif(missing_requirements(nat=True) is not None, reason=f"{missing_requirements(nat=True)}")
def test_home_routers_masquerade_drop_inbound_and_forward_on_request() -> None:
    prefix = f"pdn{os.getpid()}"
    with Testbed(hosts=3, rate_mbit=50, prefix=prefix, homes=(1, 2)) as bed:
        assert sorted(list_namespaces(prefix)) == sorted([bed.bridge_ns, *(bed.ns(i) for i in range(3)),
                                                          bed.router_ns(1), bed.router_ns(2)])
        assert bed.host_ip(1) == bed.host_ip(2) == "192.168.1.2" and bed.host_ip(0) == bed.ip(0)
        # out: the public host sees the home router's public address (masquerade)
        assert _dial(bed, 0, 1, bed.ip(0), 9100) == bed.ip(1)
        # in: a new connection to a home is dropped (a timeout, not a refusal), from the internet or another home
        assert _dial(bed, 1, 0, bed.ip(1), 9101) == "failed TimeoutError"
        assert _dial(bed, 1, 2, bed.ip(1), 9102) == "failed TimeoutError"
        # a forwarded port lets it in, to the host behind the router
        bed.forward_port(1, 9103)
        assert _dial(bed, 1, 0, bed.ip(1), 9103) == bed.ip(0)
        assert "tbf" in _qdiscs(bed.router_ns(1), "wan0")
        with pytest.raises(ValueError, match="not behind a home router"):
            bed.forward_port(0, 9104)
    assert list_namespaces(prefix) == []
