"""Bad command lines, config files, environment values and key files through the real entry points.

Every case must print exactly one line on stderr that names the problem (``expect`` below), exit with code
2, and show no traceback. Each case is its own process running the real ``main`` of ``run_peer`` or
``run_bootstrap`` with its own arguments, environment, stderr and exit status: this file, run as a script,
imports the entry points once and forks one child per case (an uncaught exception prints its traceback
and exits 1, exactly as ``python -m`` would), so 20-odd cases cost one interpreter start-up on a loaded
machine instead of twenty. None reaches the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

PEER = "p2p_diloco.cli.run_peer"
BOOT = "p2p_diloco.cli.run_bootstrap"


def _cases(d: Path) -> dict[str, tuple[str, list[str], dict[str, str], str]]:
    """name -> (module, args, extra env, text the error line must contain)."""
    return {
        "multiaddr without peer id": (PEER, ["--initial-peers", "/ip4/1.2.3.4/tcp/31337"], {}, "/p2p/<peer id>"),
        "unparsable multiaddr": (PEER, ["--initial-peers", "garbage"], {}, "cannot parse 'garbage'"),
        "unknown flag": (PEER, ["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        "group size out of range": (PEER, ["--target-group-size", "1"], {}, "target_group_size must be within"),
        "timeouts in the wrong order": (PEER, ["--matchmaking-time-s", "10", "--matchmaking-timeout-s", "5"], {},
                                        "must exceed matchmaking_time_s"),
        "chunk timeout too long": (PEER, ["--next-chunk-timeout-s", "20", "--allreduce-timeout-s", "30"], {},
                                   "below half of allreduce_timeout_s"),
        "announce port 0": (PEER, ["--announce-maddrs", "/ip4/1.2.3.4/tcp/0"], {}, "explicit port"),
        "unknown aggregation": (PEER, ["--aggregation", "median"], {}, "mean, trimmed-mean, centered-clip"),
        "norm factor too small": (PEER, ["--norm-outlier-factor", "1"], {}, "norm_outlier_factor must be 0"),
        "fragment delay past H / F": (PEER, ["--fragments", "2", "--local-steps", "10", "--fragment-delay", "6"], {},
                                      "must be in [0, local_steps / fragments = 5]"),
        "more fragments than layers": (PEER, ["--model", "tiny", "--fragments", "5", "--host-maddrs",
                                              "/ip4/127.0.0.1/tcp/0"], {}, "fewer than --fragments 5; use at most 4"),
        "weight cap zero": (PEER, ["--max-round-weight", "0"], {}, "max_round_weight must be within"),
        "missing allowed-peers file": (PEER, ["--allowed-peers", str(d / "nope.txt")], {}, "cannot read"),
        "bad allowed-peers line": (PEER, ["--allowed-peers", str(d / "badpeers.txt")], {}, "line 2"),
        "missing config file": (PEER, ["--config", str(d / "missing.yaml")], {}, "does not exist"),
        "invalid yaml": (PEER, ["--config", str(d / "bad.yaml")], {}, "is not valid"),
        "unknown config key": (PEER, ["--config", str(d / "unknown.yaml")], {}, "unknown key 'swarm.no_such_key'"),
        "bad env value": (PEER, [], {"P2P_DILOCO_TARGET_GROUP_SIZE": "abc"}, "cannot read 'abc' as int"),
        "world-readable identity key": (PEER, ["--identity-path", str(d / "open.key")], {}, "chmod 600"),
        "bad fault spec": (PEER, ["--model", "tiny", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                           {"P2P_DILOCO_FAULTS": "bogus@1"}, "P2P_DILOCO_FAULTS: cannot read 'bogus@1'"),
        "fault without its value": (PEER, ["--model", "tiny", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                                    {"P2P_DILOCO_FAULTS": "byzantine@2"}, "needs a finite number"),
        "bootstrap: bad host address": (BOOT, ["--host-maddrs", "nonsense"], {}, "cannot parse 'nonsense'"),
        "bootstrap: world-readable key": (BOOT, ["--identity-path", str(d / "open.key")], {}, "chmod 600"),
        "bootstrap: peer-only flag": (BOOT, ["--target-group-size", "4"], {}, "unrecognized arguments"),
    }


def _run_all(cases: dict, cwd: Path, out: Path) -> dict[str, dict]:
    spec = {name: [module, args, extra] for name, (module, args, extra, _) in cases.items()}
    (out / "cases.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2P_DILOCO_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(cwd))
    driver = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True, env=env,
                            cwd=cwd, timeout=280)
    assert driver.returncode == 0, driver.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict]]:
    d = tmp_path_factory.mktemp("cli")
    (d / "badpeers.txt").write_text("# first line is a comment\nnot-a-peer-id\n")
    (d / "bad.yaml").write_text("run: [unclosed\n")
    (d / "unknown.yaml").write_text("swarm:\n  no_such_key: 1\n")
    (d / "open.key").write_bytes(b"\x08\x01\x12\x40" + bytes(64))
    (d / "open.key").chmod(0o644)
    cases = _cases(d)
    results = _run_all(cases, Path(__file__).resolve().parents[2], d)
    return {name: (cases[name][3], results[name]) for name in cases}


@pytest.mark.parametrize("case", list(_cases(Path("/x"))))
def test_bad_input_gets_one_clear_line_and_exit_code_2(outcomes: dict, case: str) -> None:
    expect, proc = outcomes[case]
    lines = proc["stderr"].strip().splitlines()
    assert proc["returncode"] == 2, (proc["returncode"], proc["stderr"][-2000:])
    assert "Traceback" not in proc["stderr"]
    assert len(lines) == 1, proc["stderr"]
    assert lines[0].startswith(("run_peer: error: ", "run_bootstrap: error: ")), lines[0]
    assert expect in lines[0], lines[0]



def _fork_case(module: object, args: list[str], extra: dict[str, str], err_path: Path) -> int:
    """Run ``module.main(args)`` in a forked child with its own environment; return its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: behave like `python -m module args`
        code = 1
        try:
            os.environ.update(extra)
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            code = module.main(args) or 0  # type: ignore[attr-defined]
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(out: Path) -> None:
    import importlib

    cases = json.loads((out / "cases.json").read_text())
    modules = {name: importlib.import_module(name) for name in (PEER, BOOT)}
    results = {}
    for i, (name, (module, args, extra)) in enumerate(cases.items()):
        err_path = out / f"case{i}.err"
        code = _fork_case(modules[module], args, extra, err_path)
        results[name] = {"returncode": code, "stderr": err_path.read_text(errors="replace")}
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
