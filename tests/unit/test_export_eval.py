"""Real tokenizers and data, ``run_peer export`` from a checkpoint, ``run_peer eval``, and the hub upload call.

In-process: the same ``main`` functions the ``run_peer`` subcommands call. The live swarm variants are in
tests/integration/test_export_swarm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_assets import corpus, make_bpe_tokenizer, make_hub_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from p2p_diloco.build import build_local, build_model_and_tokenizer, held_out_batches
from p2p_diloco.checkpoint import save_checkpoint
from p2p_diloco.cli import evaluate, export, run_peer
from p2p_diloco.cli.common import make_parser, parse_config
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.models import model_fingerprint
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.trainer import evaluate_model

SMALL = ["--seq-len", "32", "--batch-size", "2", "--eval-batches", "2", "--warmup-steps", "1"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Two threads on two shared cores: OpenMP's waits cost more than they bring (5x slower evals here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(*flags: str) -> PeerConfig:
    cfg, _ = parse_config(make_parser("run_peer", "", PeerConfig), PeerConfig, list(flags))
    return cfg


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    texts = corpus("train", 9000)
    tok = make_bpe_tokenizer(root / "tokenizer", texts[:2000])
    data = root / "data.txt"
    # 9,000 rows hold out 90: more than one 64-row tokenizer batch, the case that crashed on an empty batch
    data.write_text("\n".join(texts))
    return {"tokenizer": tok, "data": data, "hub": make_hub_dataset(root / "hub", texts[:400], corpus("eval", 80))}


def _train(cfg: PeerConfig, steps: int = 1) -> float:
    local = build_local(cfg, "peer-a")
    stats = local.trainer.train_steps(steps)
    assert stats.steps == steps and torch.isfinite(torch.tensor(stats.mean_loss))
    loss = local.trainer.evaluate(local.eval_batches)
    assert 0 < loss < 20
    return loss


def test_presets_train_with_a_fast_tokenizer_folder_on_local_text_and_a_hub_layout_folder(assets) -> None:
    tok = str(assets["tokenizer"])
    cfg = config("--tokenizer", tok, "--dataset", str(assets["data"]), *SMALL)
    local = build_local(cfg, "peer-a")
    assert local.tokenizer.vocab_size == 384 and local.model.get_input_embeddings().num_embeddings == 384
    assert local.tokenizer.encode_batch([]) == []
    assert all(b.max() < 384 for b in local.eval_batches)
    _train(cfg)
    # hf:FOLDER goes through datasets.load_dataset(FOLDER, streaming=True), the code path of hf:NAME
    _train(config("--tokenizer", tok, "--dataset", f"hf:{assets['hub']}", "--virtual-shards", "2", *SMALL))


def test_a_llama_folder_saved_with_save_pretrained_trains(assets, tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    model = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(assets["tokenizer"]).save_pretrained(folder)
    _train(config("--model", str(folder), "--dataset", "embedded", *SMALL))


def _checkpoint(cfg: PeerConfig, directory: Path, epoch: int) -> torch.nn.Module:
    """A checkpoint as run_peer writes it, of a model that is not its initialisation."""
    _, model = build_model_and_tokenizer(cfg)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    state = OuterState(list(model.parameters()), device="cpu")
    manifest = {"run_id": cfg.run.run_id, "fingerprint": model_fingerprint(model, cfg.model.model),
                "model": cfg.model.model, "data_id": "x", "data_position": {"walk": 0, "row": 0}, "inner_step": 3}
    save_checkpoint(directory, epoch, state.state_tensors(), manifest)
    return model.eval()


def test_export_from_a_checkpoint_gives_the_same_logits_and_eval_loss(assets, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    tok = str(assets["tokenizer"])
    flags = ["--tokenizer", tok, "--dataset", str(assets["data"]), *SMALL]
    cfg = config(*flags)
    source = _checkpoint(cfg, tmp_path / "ckpt", epoch=7)
    out = tmp_path / "export"
    assert export.main([*flags, "--checkpoint-dir", str(tmp_path / "ckpt"), "--output", str(out),
                        "--max-shard-size", "1MB"]) == 0
    assert "at epoch 7 from checkpoint" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "README.md", "p2p_diloco.json"} <= names
    assert len([n for n in names if n.startswith("model-0")]) >= 2  # 3.4 MB of float32 above a 1 MB threshold
    info = json.loads((out / "p2p_diloco.json").read_text())
    assert info["epoch"] == 7 and info["source"] == "checkpoint" and info["tokenizer"] == tok

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-5)
    text = "the quick brown fox"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == AutoTokenizer.from_pretrained(tok)(text)["input_ids"]

    # eval of the exported folder = the peers' own evaluation function on the same parameters and batches
    tokenizer, _ = build_model_and_tokenizer(cfg)
    expected = evaluate_model(source, held_out_batches(cfg, tokenizer), torch.device("cpu"), None)
    assert evaluate.main(["--model", str(out), "--dataset", str(assets["data"]), *SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(expected, rel=1e-6) and result["epoch"] == 7
    assert result["perplexity"] == pytest.approx(torch.tensor(expected).exp().item(), rel=1e-6)
    assert result["tokens"] == 2 * 2 * 32 and result["source"] == "model"
    assert run_peer.main(["eval", *flags, "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    assert f"eval loss {expected:.4f}" in capsys.readouterr().out

    # bfloat16 and one file: --overwrite replaces the folder, shards of the first export included
    assert export.main([*flags, "--checkpoint-dir", str(tmp_path / "ckpt" / "ckpt-00000007"), "--output",
                        str(out), "--dtype", "bfloat16", "--overwrite"]) == 0
    assert "model.safetensors" in {p.name for p in out.iterdir()}
    assert not list(out.glob("model-0*")) and not list(tmp_path.glob(".tmp-*"))
    assert next(AutoModelForCausalLM.from_pretrained(out).parameters()).dtype == torch.bfloat16


def test_push_to_hub_uploads_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from huggingface_hub import CommitInfo, HfApi

    calls: list[tuple[str, dict]] = []

    def create_repo(self, repo_id: str, **kwargs):  # noqa: ANN001
        calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):  # noqa: ANN001
        calls.append(("upload_folder", {**kwargs, "files": sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())}))
        return CommitInfo(commit_url="https://huggingface.co/me/tiny/commit/abc", commit_message="",
                          commit_description="", oid="abc")

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(HfApi, "create_repo", create_repo)
        patch.setattr(HfApi, "upload_folder", upload_folder)
        assert export.main(["--source", "model", "--output", str(out), "--push-to-hub", "me/tiny", "--private"]) == 0
    assert "pushed to https://huggingface.co/me/tiny" in capsys.readouterr().out
    (create, args), (upload, kwargs) = calls
    assert args == {"repo_id": "me/tiny", "repo_type": "model", "private": True, "exist_ok": True}
    assert kwargs["repo_id"] == "me/tiny" and kwargs["repo_type"] == "model" and Path(kwargs["folder_path"]) == out
    assert kwargs["commit_message"] == "p2p_diloco run p2p-diloco-demo"
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md"} <= set(kwargs["files"])
    # the byte tokenizer is exported as ByT5's, which encodes text to the same ids
    assert AutoTokenizer.from_pretrained(out)("héllo", add_special_tokens=False)["input_ids"] == [
        b + 3 for b in "héllo".encode()]

    # the real client, offline (conftest sets HF_HUB_OFFLINE=1): one line, exit 1, the folder kept
    assert export.main(["--source", "model", "--output", str(out), "--overwrite", "--push-to-hub", "me/tiny"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot push to 'me/tiny'" in err and "offline" in err
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("argv,message", [
    (["export", "--source", "swarm", "--output", "{tmp}/o"], "--source swarm needs --initial-peers"),
    (["export", "--output", "{tmp}/o", "--max-shard-size", "lots"], "max_shard_size: cannot read 'lots'"),
    (["export", "--output", "{tmp}"], "is not empty; pass --overwrite"),
    (["export", "--checkpoint-dir", "{tmp}/none", "--output", "{tmp}/o"], "no complete checkpoint"),
    (["eval", "--source", "checkpoint"], "--source checkpoint needs --checkpoint-dir"),
    (["eval", "--model", "{tmp}/missing"], "cannot load"),
    (["plot", "{tmp}/missing.jsonl"], "does not exist"),
])
def test_usage_errors_are_one_line(argv: list[str], message: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "occupied").write_text("")
    with pytest.raises(SystemExit) as info:
        run_peer.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_a_checkpoint_of_another_model_is_refused(assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _checkpoint(config("--tokenizer", str(assets["tokenizer"]), *SMALL), tmp_path / "ckpt", epoch=1)
    with pytest.raises(SystemExit) as info:  # the byte tokenizer builds another vocabulary, so another model
        export.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "fingerprint" in err and "--tokenizer" in err
    assert not (tmp_path / "o").exists()


def test_pushing_the_live_swarms_state_needs_trusted_peers(tmp_path, capsys) -> None:  # noqa: ANN001
    """Without --trusted-peers the swarm's state is whatever donor the largest believable epoch names: any
    free identity's weights, published as the volunteers' model. Refused before anything is downloaded."""
    peer = "/ip4/127.0.0.1/tcp/31337/p2p/QmbjUdpxxxyV6TfqZGxy32XWGqZhWgs42kaYpmpsUNcytB"
    with pytest.raises(SystemExit) as exit_:
        export.main(["--source", "swarm", "--initial-peers", peer, "--push-to-hub", "user/model", "--output",
                     str(tmp_path / "out"), "--model", "tiny"])
    assert exit_.value.code == 2
    assert "--push-to-hub from the live swarm needs --trusted-peers" in capsys.readouterr().err


def test_export_from_the_swarm_asks_for_the_epoch_and_donors_a_joiner_would_believe(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The export evidence path (``cli.model_source._from_swarm``): a trusted peer at epoch 5 and a Sybil record
    claiming 10^6. The download asks for epoch 5 with the trusted set, as a joiner would: asking for the largest
    claim (before) made every honest state "too old" and the export failed."""
    from types import SimpleNamespace

    import p2p_diloco.cli.model_source as source
    from p2p_diloco.swarm.dht import ensure_identity

    trusted_id = ensure_identity(str(tmp_path / "t.key"))
    (tmp_path / "trusted.txt").write_text(f"{trusted_id}\n")
    cfg = config("--model", "tiny", "--seq-len", "64", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/" + trusted_id,
                 "--trusted-peers", str(tmp_path / "trusted.txt"))
    params = [torch.nn.Parameter(torch.zeros(3))]
    fingerprint = "abcdef0123456789"
    records = [SimpleNamespace(fingerprint=fingerprint, client_mode=False, peer_id=peer, epoch=epoch)
               for peer, epoch in ((trusted_id, 5), ("sybil", 10**6))]
    asked = []

    def download(averager, templates, opt, *, timeout, min_epoch, trusted):  # noqa: ANN001, ANN202
        asked.append((min_epoch, trusted))
        return SimpleNamespace(params=[torch.ones(3)], opt_tensors=[], epoch=min_epoch, donor=trusted_id)

    shut = SimpleNamespace(shutdown=lambda: None, peer_id=SimpleNamespace(to_base58=lambda: "me"))
    monkeypatch.setattr(source, "start_dht", lambda *a, **k: shut)
    monkeypatch.setattr(source, "RoundAverager", lambda *a, **k: shut)
    monkeypatch.setattr(source, "fetch_progress", lambda *a: records)
    monkeypatch.setattr(source, "download_state", download)
    assert source._from_swarm(cfg, fingerprint, params) == (5, f"peer {trusted_id}")
    assert asked == [(5, frozenset({trusted_id}))]
    assert torch.equal(params[0].detach(), torch.ones(3))
