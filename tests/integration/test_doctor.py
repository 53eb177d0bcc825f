"""``run_peer doctor``: the preflight, as a real process on loopback, plus its pure decisions."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from swarm_procs import env, start_bootstrap

from p2p_diloco.cli import doctor, doctor_resources, run_peer

LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--startup-timeout-s", "20", "--run-id", "doc"]


def _doctor(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli.run_peer", "doctor", *args],
                          capture_output=True, text=True, env=env(), timeout=timeout)


def _doctor_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """In this process (the daemons are still real child processes): saves an interpreter start."""
    code = run_peer.main(["doctor", *args])
    return code, capsys.readouterr().out


def _line(out: str, start: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(start)]
    assert lines, f"no line starting with {start!r} in:\n{out}"
    return lines[0]


@pytest.mark.slow
@pytest.mark.long
def test_doctor_checks_each_initial_peer_on_loopback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    boot, good = start_bootstrap(tmp_path)
    # a valid multiaddr (real peer id) of a port that is bound but not listening: nobody answers there
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}/p2p/{good.rsplit('/', 1)[1]}"
        try:
            # the dead address first: a daemon that reached the good one could not tell them apart
            mixed = _doctor(*LOOPBACK, "--initial-peers", dead, good)
            only_dead = _doctor_here(capsys, *LOOPBACK, "--initial-peers", dead)
            client = _doctor_here(capsys, *LOOPBACK, "--client-mode", "true", "--initial-peers", good)
        finally:
            boot.terminate()
            boot.wait(30)

    out = mixed.stdout
    assert mixed.returncode == 0, out + mixed.stderr
    for name in ("packages", "device", "model", "memory", "shared memory", "disk", "open files", "p2p daemon", "averager",
                 "reachability"):
        assert _line(out, "[ok  ] " + name), name
    # the port the daemon got, not the /tcp/0 it was asked for
    daemon = _line(out, "[ok  ] p2p daemon")
    assert "listening on /ip4/127.0.0.1/tcp/" in daemon and "/tcp/0" not in daemon, daemon
    assert "serves its state" in _line(out, "[ok  ] averager")
    assert "cpu" in _line(out, "[ok  ] device")
    assert "837,120 parameters" in _line(out, "[ok  ] model")
    assert _line(out, f"[ok  ] initial peer {good}").endswith("answered")
    assert "cannot connect" in _line(out, f"[warn] initial peer {dead}")
    assert "local swarm" in _line(out, "[ok  ] reachability")
    # read through the bootstrap: nobody trains run "doc" yet
    assert "no peer of run 'doc'" in _line(out, "[warn] swarm")
    assert out.rstrip().splitlines()[-1].startswith("result: ready to join")
    assert "Traceback" not in mixed.stderr

    code, out = only_dead
    assert code == 1, out
    assert "cannot connect" in _line(out, f"[FAIL] initial peer {dead}")
    assert _line(out, "       fix: is that peer running?")
    assert "none of the initial peers answered" in _line(out, "[FAIL] initial peers")
    assert out.rstrip().splitlines()[-1].startswith("result: joining would fail (2 problems)")

    # client mode, checked for real: the averager starts as run_peer's does and serves no state
    code, out = client
    assert code == 0, out
    assert "client mode" in _line(out, "[ok  ] averager") and "serves none" in _line(out, "[ok  ] averager")
    assert "client mode" in _line(out, "[ok  ] reachability")
    assert out.rstrip().splitlines()[-1].startswith("result: ready to join")


def test_doctor_refuses_client_mode_without_initial_peers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_peer.main(["doctor", *LOOPBACK, "--client-mode", "true"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("run_peer doctor: error: --client-mode") and "--initial-peers" in err[0]


@pytest.mark.slow
def test_doctor_fails_on_a_port_already_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = _doctor_here(capsys, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--run-id", "doc")
    assert code == 1, out
    line = _line(out, "[FAIL] p2p daemon")
    assert f"/tcp/{port}" in line and "already in use" in line and "/tcp/0" in line
    assert "not checked" in _line(out, "[warn] initial peers")
    assert out.rstrip().splitlines()[-1].startswith("result: joining would fail (1 problem)")


def test_doctor_usage_error_is_one_line_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_peer.main(["doctor", "--inner-lr", "-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("run_peer doctor: error: --inner-lr") and "(0.0, 1.0]" in err[0]


ME = "12D3KooWL8Xcn9NDbfi5kjMhNaSNhnVXoYpc6A7PeMkwTKFZkynU"
# 1.2.3.4 and 5.6.7.8 are global unicast addresses; nothing here dials them
PUBLIC_PEER = "/ip4/1.2.3.4/tcp/31337/p2p/QmcPFB5kbZHwxYhya9RBqC5yXLEbuuBwffRyqoB8vTqRuL"
LAN_PEER = "/ip4/192.168.1.20/tcp/31337/p2p/QmcPFB5kbZHwxYhya9RBqC5yXLEbuuBwffRyqoB8vTqRuL"


def test_reachability_decisions() -> None:
    from p2p_diloco.swarm.reach import is_public  # what the doctor classifies addresses with

    private = ["/ip4/192.168.1.5/tcp/4000/p2p/" + ME, "/ip4/127.0.0.1/tcp/4000/p2p/" + ME]
    # behind NAT, joining an internet swarm: others could not dial us -> fail, with the three ways out
    verdict = doctor.classify_reachability(private, [PUBLIC_PEER], client_mode=False)
    assert verdict.status == "fail"
    assert all(flag in verdict.fix for flag in ("--client-mode", "--announce-maddrs", "--use-auto-relay"))
    assert doctor.classify_reachability(private, [PUBLIC_PEER], client_mode=True).status == "ok"
    assert doctor.classify_reachability(private + ["/ip4/5.6.7.8/tcp/4000/p2p/" + ME], [PUBLIC_PEER],
                                        client_mode=False).status == "ok"
    relayed = private + [PUBLIC_PEER + "/p2p-circuit/p2p/" + ME]
    assert "relay" in doctor.classify_reachability(relayed, [PUBLIC_PEER], client_mode=False).detail
    assert doctor.classify_reachability(private, [LAN_PEER], client_mode=False).status == "ok"
    assert doctor.classify_reachability(private, [], client_mode=False).status == "warn"
    assert is_public("/dns4/boot.example.org/tcp/31337") and not is_public("/ip6/::1/tcp/1")


def test_requirement_clash_is_reported() -> None:
    requires = {"hivemind": ["protobuf>=5.29.0", "msgpack>=0.5.6", 'pytest==8.3.5; extra == "dev"'],
                "p2p-diloco": ["hivemind<1.2,>=1.1.10", "tomli>=2.0; python_version < '3.0'"]}
    installed = {"protobuf": "4.25.3", "hivemind": "1.1.12"}
    assert doctor.unmet_requirements(requires, installed) == [
        "hivemind needs protobuf>=5.29.0, found protobuf 4.25.3",
        "hivemind needs msgpack>=0.5.6, which is not installed",
    ]
    installed.update(protobuf="5.29.1", msgpack="1.0.0")
    assert doctor.unmet_requirements(requires, installed) == []
    # this environment itself is consistent
    assert doctor.check_packages().status == "ok"


def test_memory_and_disk_estimates_follow_the_real_model() -> None:
    from p2p_diloco.models import build_model, count_parameters

    shape = doctor_resources.model_shape("tiny", None, 128)
    assert shape.parameters == count_parameters(build_model("tiny", 259, 128))
    fp32 = doctor_resources.training_bytes(shape, micro_batch=16, seq_len=128, low_precision=False)
    assert fp32 > 16 * shape.parameters
    assert doctor_resources.training_bytes(shape, 8, 128, False) < fp32  # a smaller micro-batch is the documented fix
    assert doctor_resources.checkpoint_bytes(shape.parameters, momentum=0.9) == 8 * shape.parameters
    assert doctor_resources.checkpoint_bytes(shape.parameters, momentum=0.0) == 4 * shape.parameters


def test_swarm_decisions_and_our_fingerprint() -> None:
    from p2p_diloco.config_loader import build
    from p2p_diloco.models import build_model, model_fingerprint
    from p2p_diloco.peer.config import PeerConfig
    from p2p_diloco.swarm.records import PeerProgress

    cfg = build(PeerConfig, None, None, environ={}, base={"model.seq_len": 64})
    ours = doctor_resources.model_fingerprint_of(cfg)
    assert ours == model_fingerprint(build_model("tiny", 259, 64), "tiny")

    def record(peer: str, epoch: int, fingerprint: str) -> PeerProgress:
        return PeerProgress(peer, epoch, 0, 1.0, 1.0, 1.0, fingerprint, 0.0, False, 0.0)

    same = doctor.classify_swarm([record("a", 3, ours), record("b", 4, "f" * 16)], "r", ours)
    assert same.status == "ok" and "2 peer(s)" in same.detail and "epoch 4" in same.detail
    other = doctor.classify_swarm([record("a", 3, "f" * 16)], "r", ours)
    assert other.status == "fail" and "--model" in other.fix
    assert doctor.classify_swarm([record("a", 3, "f" * 16)], "r", None).status == "ok"
    assert doctor.classify_swarm([], "r", ours).status == "warn"

    # a client-mode peer needs a full peer of its model: only full peers reduce parts and serve state
    def client(peer: str, epoch: int, fingerprint: str) -> PeerProgress:
        return PeerProgress(peer, epoch, 0, 1.0, 1.0, 1.0, fingerprint, 0.0, True, 0.0)

    alone = doctor.classify_swarm([client("a", 3, ours), record("b", 3, "f" * 16)], "r", ours, client_mode=True)
    assert alone.status == "warn" and "full peer" in alone.detail and "--client-mode" in alone.fix
    assert doctor.classify_swarm([client("a", 3, ours)], "r", ours, client_mode=False).status == "ok"
    through = doctor.classify_swarm([client("a", 3, ours), record("b", 3, ours)], "r", ours, client_mode=True)
    assert through.status == "ok" and "1 of them full" in through.detail
