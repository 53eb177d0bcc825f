"""Every command in the guides is exercised, and every shipped config and deployment file parses.

How a command counts as exercised:

- every ``run_peer``/``run_bootstrap`` command (also inside ``nice``, ``systemd-run``, ``docker run`` or a
  systemd unit) is parsed here by the programs' real argument parser and config builder, so a renamed
  flag or an invalid value in a guide fails this file;
- the safe ones run for real here: the ``--help`` commands, the torch check, and the README's local swarm
  (its bootstrap command, then its preflight and the preflight with ``peers/peer.yaml``, on loopback);
- commands that need hardware, root or the internet (CUDA installs, systemctl, docker, a real swarm) are
  listed in ``COVERAGE`` with the test or script that runs the same code path, and each entry says why
  that is the same path;
- system tools that run no code of this project (``git pull``, ``journalctl``, ``useradd``) are listed as
  external, with the reason.

A new command in a guide without an entry fails ``test_every_guide_command_is_exercised``.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from swarm_procs import env, wait_for_maddr

from p2p_diloco.cli import evaluate, export, plot, run_bootstrap, run_peer
from p2p_diloco.cli.common import make_parser, parse_config
from p2p_diloco.cli.run_bootstrap import BootstrapConfig
from p2p_diloco.config_loader import build
from p2p_diloco.peer.config import PeerConfig

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ["README.md", "peers/README.md", "bootstrap/README.md"]
INSTALL_PREFIX = "/opt/p2p_diloco"
"""Where the systemd units and the Dockerfile expect the repository; mapped to this checkout here."""
EXAMPLE_ID = "Qmaf8sfvuGRsMGzoFTCDPqt474JGhnYTRWHuRJUwaKyVGV"

# (pattern matched against the whole command, what exercises it). "here" means this file parses (and,
# where marked in the test names, runs) the command with the real code; "external: ..." marks a command
# that runs no code of this project (a system tool), with the reason it is left to that tool.
COVERAGE: list[tuple[str, str]] = [
    # set-up: scripts/test.sh runs scripts/setup.sh before every suite; the CUDA index variant only
    # changes pip's index URL, which needs a GPU host and the internet.
    (r"bash scripts/setup\.sh", "scripts/test.sh"),
    (r"TORCH_INDEX_URL=\S+ bash scripts/setup\.sh", "scripts/test.sh"),
    (r"bash scripts/demo\.sh", "scripts/demo.sh"),
    (r"bash scripts/test\.sh( -n 2 --dist loadfile| --quick| --long| --all)?", "scripts/test.sh"),
    (r"\.venv/bin/python scripts/flake_gate\.py \d+( \S+)*",
     "tests/unit/test_flake_gate.py::test_the_gate_counts_each_tests_failures_across_runs"),
    (r"\.venv/bin/python -c .*torch.*", "tests/integration/test_docs.py::test_torch_check_command_runs"),
    # the CLIs: parsed here; the doctor runs here on loopback and in tests/integration/test_doctor.py; training and
    # bootstrap nodes run in the multi-peer tests (same programs, loopback addresses).
    (r".*run_peer (doctor )?--help", "tests/integration/test_docs.py::test_help_commands_run"),
    (r".*run_bootstrap --help", "tests/integration/test_docs.py::test_help_commands_run"),
    (r".*run_peer doctor .*|.*python -m p2p_diloco\.cli\.doctor .*",
     "tests/integration/test_docs.py::test_readme_local_swarm_and_preflight"),
    # after training: the README's checkpoint and folder commands run here; the swarm variant and the plot
    # run in the live-swarm test (same subcommands, loopback addresses)
    (r".*run_peer (export|eval) (?!.*--initial-peers).*", "tests/integration/test_docs.py::test_readme_after_training_commands_run"),
    (r".*run_peer (export|eval) .*--initial-peers .*",
     "tests/integration/test_export_swarm.py::test_export_and_eval_from_a_live_swarm_and_its_checkpoints"),
    (r".*run_peer export .*--push-to-hub .*", "tests/unit/test_export_eval.py::test_push_to_hub_uploads_the_folder"),
    (r".*run_peer plot .*",
     "tests/integration/test_export_swarm.py::test_export_and_eval_from_a_live_swarm_and_its_checkpoints"),
    # the NAT choices of peers/README.md: each parsed and checked in test_nat_choices_of_the_peer_guide; client
    # mode also runs for real, in the doctor on loopback and in a swarm with full peers
    (r"run_peer --config peers/peer\.yaml --client-mode",
     "tests/integration/test_client_mode_swarm.py::test_client_mode_peer_joins_downloads_and_averages_with_full_peers"),
    (r"run_peer --config peers/peer\.yaml (--client-mode|--host-maddrs .* --announce-maddrs .*|--use-relay --use-auto-relay)",
     "tests/integration/test_docs.py::test_nat_choices_of_the_peer_guide"),
    # a node of several GPUs: the same torchrun launch (2 gloo ranks on loopback), killed and resumed
    (r"(CUDA_VISIBLE_DEVICES=\S+ )?torchrun --standalone --nproc-per-node \d+ '\$\(which' 'run_peer\)' .*",
     "tests/integration/test_node_swarm.py::test_node_of_two_ranks_averages_with_a_peer_dies_cleanly_and_resumes"),
    (r".*run_peer .*", "tests/integration/test_peer_swarm.py::test_three_peers_train_fold_late_work_and_admit_a_joiner"),
    (r".*run_bootstrap .*", "tests/integration/test_docs.py::test_readme_local_swarm_and_preflight"),
    # deployment: the units' ExecStart lines and the image's ENTRYPOINT/CMD are parsed here; systemd and
    # docker themselves need root or a GPU host and are not run by the suite.
    (r"sudo cp \S+\.service /etc/systemd/system/", "tests/integration/test_docs.py::test_deployment_files_parse"),
    (r"sudo systemctl .*", "tests/integration/test_docs.py::test_deployment_files_parse"),
    (r"docker (build|stop) .*", "tests/integration/test_docs.py::test_deployment_files_parse"),
    # `docker run IMAGE ARGS` runs run_peer with ARGS (parsed here); without ARGS, the image's CMD
    (r"docker run .* p2p-diloco-peer doctor .*", "tests/integration/test_docs.py::test_readme_local_swarm_and_preflight"),
    (r"docker run .* p2p-diloco-peer", "tests/integration/test_docs.py::test_deployment_files_parse"),
    # the fix the node prints for a readable key; the test checks the message and that 0600 is accepted
    (r"chmod 600 \S+", "tests/integration/test_swarm_dht.py::test_readable_identity_is_refused"),
    (r"rm -rf \.venv", "external: removes the environment so that scripts/setup.sh recreates it"),
    (r"source \.venv/bin/activate", "external: the venv's own activation script"),
    (r"sudo useradd .*", "external: creates the service user (root only)"),
    (r"sudo ufw allow \S+", "external: firewall rule (root only)"),
    (r"journalctl .*", "external: reads the service's log"),
    (r"git pull", "external: fetches the new version before scripts/setup.sh reinstalls it"),
]


def guide_commands(path: Path) -> list[str]:
    """Shell commands of the ``bash``/``sh`` fenced blocks: continuations joined, comments dropped."""
    commands, block = [], None
    for line in path.read_text().splitlines():
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            block = fence.group(1) if block is None else None
            continue
        if block in ("bash", "sh", "shell"):
            text = line.strip()
            if commands and commands[-1].endswith("\\"):
                commands[-1] = commands[-1][:-1] + " " + text
            elif text and not text.startswith("#"):
                commands.append(text)
    return [shlex.join(shlex.split(c, comments=True)) for c in commands]


def cli_args(command: str) -> tuple[str, list[str]] | None:
    """The program (run_peer, run_bootstrap, doctor) and its arguments, unwrapped from env, nice, etc."""
    words = shlex.split(command)
    if words[:2] == ["docker", "run"]:
        image = next(i for i, w in enumerate(words) if w == "p2p-diloco-peer")
        return "run_peer", words[image + 1:]
    for i, word in enumerate(words):
        name = Path(word.removesuffix(")")).name  # torchrun ... $(which run_peer) ...
        if name in ("run_peer", "run_bootstrap"):
            return name, words[i + 1:]
        if word == "-m" and words[i + 1] == "p2p_diloco.cli.doctor":
            return "run_peer", ["doctor", *words[i + 2:]]
    return None


def parse_cli(program: str, args: list[str]) -> object:
    """Build the config exactly as the program would, without running it."""
    args = [a.replace(INSTALL_PREFIX, str(ROOT)).replace("PEER_ID", EXAMPLE_ID) for a in args]
    args = [str(ROOT / a) if a.endswith((".yaml", ".toml")) and not Path(a).is_absolute() else a for a in args]
    if program == "run_peer" and args[:1] == ["doctor"]:
        args = args[1:]
    if program == "run_peer" and args[:1] == ["plot"]:
        return plot.build_parser().parse_args(args[1:])
    cls = PeerConfig if program == "run_peer" else BootstrapConfig
    parser = make_parser(program, "", cls)
    if program == "run_peer" and args[:1] in (["export"], ["eval"]):
        parser = {"export": export, "eval": evaluate}[args[0]].build_parser()
        args = args[1:]
    cfg, _ = parse_config(parser, cls, args)
    return cfg


ALL_COMMANDS = [(doc, c) for doc in GUIDES for c in guide_commands(ROOT / doc)]


def test_guides_have_commands() -> None:
    for doc in GUIDES:
        assert len([c for d, c in ALL_COMMANDS if d == doc]) >= 3, doc


def test_every_guide_command_is_exercised() -> None:
    missing = []
    for doc, command in ALL_COMMANDS:
        covers = [by for pattern, by in COVERAGE if re.fullmatch(pattern, command)]
        if not covers:
            missing.append(f"{doc}: {command}")
            continue
        for by in covers:
            target, _, name = by.partition("::")
            if target.startswith("external: "):
                continue
            assert (ROOT / target).exists(), by
            if name:
                assert re.search(rf"^def {name}\(", (ROOT / target).read_text(), re.M), by
    assert not missing, "commands in the guides that nothing exercises (add them to COVERAGE):\n" + "\n".join(
        missing)


@pytest.mark.parametrize("doc,command", [(d, c) for d, c in ALL_COMMANDS if cli_args(c) and "--help" not in c])
def test_cli_command_parses_with_the_real_parser(doc: str, command: str) -> None:
    program, args = cli_args(command)  # type: ignore[misc]
    cfg = parse_cli(program, args)
    if isinstance(cfg, PeerConfig) and "--initial-peers" in args:
        assert cfg.swarm.initial_peers and all("/p2p/" in p for p in cfg.swarm.initial_peers)


def test_help_commands_run(capsys: pytest.CaptureFixture[str]) -> None:
    for main, argv, prog in ((run_peer.main, ["--help"], "run_peer"), (run_peer.main, ["doctor", "--help"],
                             "run_peer doctor"), (run_bootstrap.main, ["--help"], "run_bootstrap")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: {prog}") and "--initial-peers" in out


def test_torch_check_command_runs() -> None:
    (command,) = [c for d, c in ALL_COMMANDS if c.startswith(".venv/bin/python -c")]
    words = shlex.split(command)
    result = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=120, env=env())
    assert result.returncode == 0, result.stderr
    version, available = result.stdout.split()
    import torch

    assert version == torch.__version__ and available == str(torch.cuda.is_available())


def test_shipped_config_files_parse() -> None:
    peer_files = sorted((ROOT / "peers").glob("*.yaml")) + sorted((ROOT / "peers").glob("*.toml"))
    boot_files = sorted((ROOT / "bootstrap").glob("*.yaml")) + sorted((ROOT / "bootstrap").glob("*.toml"))
    assert peer_files and boot_files
    for path in peer_files:
        cfg = build(PeerConfig, None, str(path), environ={})
        assert len(cfg.swarm.initial_peers) >= 2 and cfg.run.resume and cfg.run.checkpoint_dir
        assert cfg.swarm.run_id == cfg.run.run_id
    for path in boot_files:
        cfg = build(BootstrapConfig, None, str(path), environ={})
        assert cfg.identity_path and cfg.announce_maddrs and cfg.initial_peers
        cfg.swarm()  # the swarm settings it starts with validate too


def test_deployment_files_parse() -> None:
    units = sorted(ROOT.glob("*/*.service"))
    assert {u.parent.name for u in units} >= {"peers", "bootstrap"}
    for unit in units:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string(unit.read_text())
        exec_start = parser["Service"]["ExecStart"]
        assert exec_start.startswith(INSTALL_PREFIX + "/.venv/bin/"), unit
        program, args = cli_args(exec_start)  # type: ignore[misc]
        assert program == {"peers": "run_peer", "bootstrap": "run_bootstrap"}[unit.parent.name]
        parse_cli(program, args)
        assert "2" in parser["Service"]["RestartPreventExitStatus"].split()  # usage errors are not retried
    dockerfile = (ROOT / "peers" / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", dockerfile, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.+)$", dockerfile, re.M).group(1))
    assert entry == ["run_peer"]
    cfg = parse_cli("run_peer", [a.replace("/opt/p2p_diloco", INSTALL_PREFIX) for a in cmd])
    assert cfg.run.resume and cfg.run.checkpoint_dir.startswith("/data/")
    for copied in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (ROOT / copied).exists(), copied


PRIVATE = ["/ip4/192.168.1.5/tcp/31338/p2p/" + EXAMPLE_ID]
PUBLIC_BOOTSTRAP = "/ip4/1.2.3.4/tcp/31337/p2p/QmXFXEErbg3kDvTRQr6t1bwxuo4UkuLv1XbYdiyxQrukuN"


def nat_choices() -> list[str]:
    """The commands of peers/README.md's NAT section, in order."""
    text = (ROOT / "peers" / "README.md").read_text()
    section = re.search(r"^## \d+\. Behind NAT.*?(?=^## )", text, re.M | re.S)
    assert section, "peers/README.md has no 'Behind NAT' section"
    lines = {line.strip() for line in section.group(0).splitlines()}
    return [c for c in guide_commands(ROOT / "peers" / "README.md") if c in lines]


def test_nat_choices_of_the_peer_guide() -> None:
    """The three NAT choices the peer guide offers are what the doctor advises, and each sets what it says."""
    from p2p_diloco.cli import doctor

    choices = nat_choices()
    assert len(choices) == 3, choices
    client, forward, relay = (parse_cli(*cli_args(c)) for c in choices)  # type: ignore[misc]
    # 1. client mode joins the swarm of peer.yaml's initial peers (a client cannot start one)
    assert client.swarm.client_mode and client.swarm.initial_peers
    assert doctor.classify_reachability(PRIVATE, [PUBLIC_BOOTSTRAP], client.swarm.client_mode).status == "ok"
    # 2. a forwarded port: listen on it and announce the public address with the same port
    assert not forward.swarm.client_mode
    listen_port = forward.swarm.host_maddrs[0].rsplit("/", 1)[1]
    assert forward.swarm.host_maddrs[0] == f"/ip4/0.0.0.0/tcp/{listen_port}"
    assert forward.swarm.announce_maddrs and all(a.endswith(f"/tcp/{listen_port}") for a in forward.swarm.announce_maddrs)
    # 3. a relay
    assert relay.swarm.use_relay and relay.swarm.use_auto_relay and not relay.swarm.client_mode
    # the doctor's fix for an unreachable peer names exactly these three
    verdict = doctor.classify_reachability(PRIVATE, [PUBLIC_BOOTSTRAP], client_mode=False)
    assert verdict.status == "fail"
    assert all(flag in verdict.fix for flag in ("--client-mode", "--announce-maddrs", "--use-auto-relay"))
    # a client needs initial peers: the guide's promise that it joins a swarm, checked by the real parser
    with pytest.raises(SystemExit) as exit_info:
        parse_cli("run_peer", ["--client-mode"])
    assert exit_info.value.code == 2


def test_readme_model_table_states_the_presets_parameter_counts() -> None:
    """Each preset's count in the README (byte vocabulary, and 32k where stated) is what the preset builds."""
    import torch
    from transformers import LlamaForCausalLM

    from p2p_diloco.data.tokenizer import load_tokenizer
    from p2p_diloco.models import PRESETS, count_parameters, preset_config

    byte_vocab = load_tokenizer("byte", "tiny", tuple(PRESETS)).vocab_size
    rows = dict(re.findall(r"^\| `(\w+)` \| Llama, (.+?) \|$", (ROOT / "README.md").read_text(), re.M))
    assert set(rows) == set(PRESETS), rows

    def close(stated: str, vocab: int, name: str) -> bool:
        with torch.device("meta"):  # shapes only: the 150m preset costs no memory here
            count = count_parameters(LlamaForCausalLM(preset_config(name, vocab, 128)))
        decimals = len(stated.partition(".")[2])
        return abs(float(stated) - count / 1e6) <= 0.5 * 10**-decimals

    for name, text in rows.items():
        stated = re.match(r"~([\d.]+)M parameters", text)
        assert stated and close(stated.group(1), byte_vocab, name), (name, text)
        big = re.search(r"~([\d.]+)M with a 32k vocabulary", text)
        assert big is None or close(big.group(1), 32000, name), (name, text)


def test_bootstrap_guide_says_which_runs_the_swarm_metrics_show() -> None:
    """The default --monitor-run-ids is the demo run only: the guide must say so and show how to list a run."""
    text = " ".join((ROOT / "bootstrap" / "README.md").read_text().split())
    default = BootstrapConfig.__dataclass_fields__["monitor_run_ids"].default_factory()  # type: ignore[misc]
    assert default == ["p2p-diloco-demo"]
    assert "`--monitor-run-ids`, which defaults to the demo run `p2p-diloco-demo`" in text
    commands = [c for d, c in ALL_COMMANDS if d == "bootstrap/README.md" and "--monitor-run-ids" in c]
    assert commands, "no bootstrap command lists the runs to monitor"
    cfg = parse_cli(*cli_args(commands[0]))  # type: ignore[misc]
    assert cfg.metrics_port and set(cfg.monitor_run_ids) - set(default)


def _readme_block_command(program: str, *must: str) -> list[str]:
    found = [c for d, c in ALL_COMMANDS if d == "README.md" and program in c and all(m in c for m in must)]
    assert found, (program, must)
    return shlex.split(found[0])


def parse_args_for_loopback(args: list[str], maddr: str, tmp_path: Path) -> list[str]:
    """A guide command's arguments with its config file resolved and the network pointed at loopback."""
    args = [str(ROOT / a) if a.endswith((".yaml", ".toml")) else a for a in args]
    return [*args, "--initial-peers", maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path",
            str(tmp_path / "nat.id"), "--checkpoint-dir", str(tmp_path / "ckpt")]


@pytest.mark.slow
@pytest.mark.long
def test_readme_local_swarm_and_preflight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's local swarm: its bootstrap command, then its preflight, both for real on loopback.

    Only the port (31337 may be taken on a shared machine) and the identity path are substituted. The
    preflight with ``peers/peer.yaml`` follows, with the network flags pointed at loopback (the file's
    initial peers are documentation addresses, which tests must not dial).
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    boot_cmd = [w.replace("31337", port).replace("bootstrap.id", str(tmp_path / "bootstrap.id"))
                for w in _readme_block_command("run_bootstrap", "127.0.0.1")]
    assert Path(boot_cmd[0]).name == "run_bootstrap"
    out = open(tmp_path / "bootstrap.out", "w")
    # The program the README names, run by this interpreter: the checkout need not hold a .venv.
    boot = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", *boot_cmd[1:]], stdout=out,
                            stderr=subprocess.STDOUT, env=env(), cwd=ROOT)
    try:
        maddr = wait_for_maddr(tmp_path / "bootstrap.out", boot)
        assert f"/tcp/{port}/p2p/" in maddr
        peer_id = maddr.rsplit("/", 1)[1]
        doctor_cmd = [w.replace("31337", port).replace("PEER_ID", peer_id)
                      for w in _readme_block_command("run_peer", "doctor", "127.0.0.1")]
        assert doctor_cmd[1] == "doctor"
        assert run_peer.main(doctor_cmd[1:]) == 0
        assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("result: ready to join")

        code = run_peer.main(["doctor", "--config", str(ROOT / "peers" / "peer.yaml"), "--initial-peers", maddr,
                              "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path",
                              str(tmp_path / "peer.id"), "--checkpoint-dir", str(tmp_path / "ckpt")])
        report = capsys.readouterr().out
        assert code == 0, report
        assert "small:" in report and "[ok  ] disk" in report

        # the guide's first NAT choice, client mode, checked for real by the doctor (its averager starts as
        # run_peer's does and serves no state)
        client = cli_args(nat_choices()[0])[1]  # type: ignore[index]
        code = run_peer.main(["doctor", *parse_args_for_loopback(client, maddr, tmp_path)])
        report = capsys.readouterr().out
        assert code == 0, report
        assert "[ok  ] averager: client mode" in report and "[ok  ] reachability: client mode" in report
    finally:
        boot.terminate()
        boot.wait(30)
        out.close()


def test_readme_after_training_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The README's export and eval commands that need no swarm, for real, on a checkpoint as run_peer writes
    it (``ckpt`` and ``my-model`` mapped into a temporary folder); the push goes as far as the upload call."""
    import torch
    from huggingface_hub import HfApi
    from transformers import AutoModelForCausalLM

    from p2p_diloco.build import build_model_and_tokenizer
    from p2p_diloco.checkpoint import save_checkpoint
    from p2p_diloco.core.peer_state import OuterState
    from p2p_diloco.models import model_fingerprint

    cfg = build(PeerConfig, None, None, environ={})
    _, model = build_model_and_tokenizer(cfg)
    manifest = {"run_id": cfg.run.run_id, "fingerprint": model_fingerprint(model, cfg.model.model),
                "model": cfg.model.model}
    save_checkpoint(tmp_path / "ckpt", 3, OuterState(list(model.parameters()), device="cpu").state_tensors(), manifest)
    uploads: list[dict] = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: uploads.append(kw) or "commit")
    commands = [c for d, c in ALL_COMMANDS if d == "README.md" and re.match(r"\S*run_peer (export|eval) ", c)
                and "--initial-peers" not in c]
    assert len(commands) >= 4
    mapped = {"ckpt": str(tmp_path / "ckpt"), "my-model": str(tmp_path / "my-model")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores: OpenMP's waits cost more than they bring
    try:
        for command in commands:
            words = [mapped.get(w, w) for w in shlex.split(command)]
            assert run_peer.main(words[1:]) == 0, command
            out = capsys.readouterr().out
            if words[1] == "eval" and "--json" in words:
                assert json.loads(out)["epoch"] == 3
            elif words[1] == "eval":
                assert "at epoch 3 from checkpoint" in out and "perplexity" in out
    finally:
        torch.set_num_threads(threads)
    assert [u["repo_id"] for u in uploads] == ["your-name/my-model"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "my-model")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters(), strict=True))
