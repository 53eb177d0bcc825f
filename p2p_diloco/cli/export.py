"""``run_peer export``: the trained model as a standard Hugging Face folder, optionally pushed to the hub.

::

    run_peer export --model small --checkpoint-dir ckpt --output my-model          # from a checkpoint
    run_peer export --model small --initial-peers MADDR --output my-model          # from the live swarm
    run_peer export ... --output my-model --push-to-hub me/my-model                 # and upload it

The folder holds what every tool that reads Hugging Face models expects: ``config.json``, the weights in
safetensors (``model.safetensors``, or shards plus ``model.safetensors.index.json`` above
``--max-shard-size``), ``generation_config.json``, the tokenizer (the byte tokenizer is written as the
equivalent ``ByT5Tokenizer``), a model card ``README.md``, and ``p2p_diloco.json`` with where the parameters
came from (run, epoch, sha256). ``AutoModelForCausalLM.from_pretrained(folder)`` gives the swarm's logits.

The folder is written next to its final place and renamed into it, so a failed export leaves an existing
folder untouched; replacing a non-empty folder needs ``--overwrite``. Pushing goes through
``huggingface_hub`` (token from ``HF_TOKEN`` or ``huggingface-cli login``); a failed push keeps the folder.
Exit codes: 0 done, 1 the swarm or the hub failed, 2 usage error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from p2p_diloco import __version__
from p2p_diloco.cli.common import Parser, make_parser, parse_config, setup_logging, usage_error
from p2p_diloco.cli.model_source import (
    INFO_FILE,
    LoadedModel,
    SourceError,
    add_source_argument,
    load_model,
    quiet_progress_bars,
    resolve_source,
)
from p2p_diloco.models import PRESETS, count_parameters
from p2p_diloco.peer.config import PeerConfig

logger = logging.getLogger(__name__)
PROG = "run_peer export"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD = "5GB"
"""The hub's recommended largest file: bigger single files upload and resume badly."""


def parse_size(text: str) -> int:
    """Bytes in ``"5GB"``, ``"500MB"``, ``"1000000"``; ``ValueError`` with the accepted forms otherwise."""
    from transformers.utils.hub import convert_file_size_to_int

    text = text.strip()
    try:
        size = int(text) if text.isdigit() else convert_file_size_to_int(text)
    except (ValueError, TypeError, AttributeError):
        size = None
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"max_shard_size: cannot read {text!r}; use bytes or a size like 500MB or 5GB")
    return size


def export_info(loaded: LoadedModel, cfg: PeerConfig, dtype: str) -> dict[str, Any]:
    return {
        "run_id": cfg.run.run_id, "model": cfg.model.model, "fingerprint": loaded.fingerprint,
        "source": loaded.source, "origin": loaded.origin, "epoch": loaded.epoch,
        "params_sha256": loaded.params_sha256, "seq_len": cfg.model.seq_len, "dtype": dtype,
        "tokenizer": cfg.data.tokenizer or ("byte" if cfg.model.model in PRESETS else cfg.model.model),
        "parameters": count_parameters(loaded.model), "exported_unix": time.time(),
        "p2p_diloco_version": __version__,
    }


def model_card(info: dict[str, Any]) -> str:
    epoch = "unknown" if info["epoch"] is None else info["epoch"]
    return (
        "---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- p2p-diloco\n- diloco\n---\n\n"
        f"# {info['run_id']}\n\n"
        f"A {info['parameters']:,}-parameter causal language model trained by the volunteers of the p2p_diloco "
        f"run `{info['run_id']}` (DiLoCo over a hivemind swarm), exported at outer epoch {epoch}.\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER_OR_REPO")\n'
        'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER_OR_REPO")\n```\n\n'
        f"| | |\n| --- | --- |\n| model | `{info['model']}` (fingerprint `{info['fingerprint']}`) |\n"
        f"| tokenizer | `{info['tokenizer']}` |\n| sequence length | {info['seq_len']} |\n"
        f"| parameters from | {info['source']}: {info['origin']} |\n"
        f"| parameters sha256 | `{info['params_sha256']}` |\n| weights dtype | {info['dtype']} |\n"
    )


def write_folder(loaded: LoadedModel, cfg: PeerConfig, output: Path, *, max_shard_size: int, dtype: str,
                 overwrite: bool) -> list[str]:
    """Write the Hugging Face folder atomically; returns the file names written."""
    output = output.expanduser().absolute()
    if output.exists() and not output.is_dir():
        raise SourceError(f"--output {str(output)!r} is a file; give a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise SourceError(f"--output {str(output)!r} is not empty; pass --overwrite to replace it, or another folder")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{output.name}-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the export is meant to be shared
        model = loaded.model.to("cpu", DTYPES[dtype])
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        loaded.tokenizer.save_pretrained(str(tmp))
        info = export_info(loaded, cfg, dtype)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(model_card(info))
        if output.exists():
            old = output.parent / f".tmp-old-{output.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(output, old)
            os.replace(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as SafetensorError
        raise SourceError(f"cannot write {str(output)!r}: {getattr(e, 'strerror', None) or e}; the previous "
                          "folder, if any, is untouched", usage=False) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(p.name for p in output.iterdir())


def push_folder(folder: Path, repo_id: str, *, private: bool, commit_message: str) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` as one commit; returns the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                               commit_message=commit_message)
    return str(getattr(commit, "commit_url", commit))


def build_parser() -> Parser:
    """``run_peer``'s flags plus the export's own."""
    parser = make_parser(PROG, "Write the run's model as a Hugging Face folder (and optionally push it).", PeerConfig)
    add_source_argument(parser)
    parser.add_argument("--output", metavar="DIR", required=True, help="the folder to write")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD,
                        help="largest weights file; bigger models are split into shards plus an index")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="dtype of the written weights; bfloat16 halves the size (training runs in float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None,
                        help="upload the folder to this Hugging Face model repository (user/name), creating it")
    parser.add_argument("--private", action="store_true", help="create the hub repository as private")
    parser.add_argument("--commit-message", default=None, help="hub commit message (default: names the epoch)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse_config(build_parser(), PeerConfig, sys.argv[1:] if argv is None else list(argv))
    setup_logging(args.verbose)
    quiet_progress_bars()
    try:
        max_shard = parse_size(args.max_shard_size)
    except ValueError as e:
        usage_error(PROG, str(e))
    if args.push_to_hub is not None and args.push_to_hub.count("/") > 1:
        usage_error(PROG, f"--push-to-hub {args.push_to_hub!r}: give a repository as user/name or name")
    if args.push_to_hub and resolve_source(args.source, cfg) == "swarm" and not cfg.swarm.trusted_peers:
        # Without trusted peers the state comes from whichever donor the largest believable epoch names: any
        # free identity's, which the model card would then credit to the run's volunteers.
        usage_error(PROG, "--push-to-hub from the live swarm needs --trusted-peers FILE (the run's organisers' "
                          "peers), so that only a state they vouch for is published; or export to a folder "
                          "without --push-to-hub, check it (run_peer evaluate), then push that folder")
    output = Path(args.output)
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:
        usage_error(PROG, f"--output {str(output)!r} is not empty; pass --overwrite to replace it, or another folder")
    try:
        loaded = load_model(cfg, args.source)
        files = write_folder(loaded, cfg, output, max_shard_size=max_shard, dtype=args.dtype,
                             overwrite=args.overwrite)
    except SourceError as e:
        if e.usage:
            usage_error(PROG, str(e))
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    epoch = "" if loaded.epoch is None else f" at epoch {loaded.epoch}"
    print(f"exported {count_parameters(loaded.model):,}-parameter {cfg.model.model}{epoch} from {loaded.source} "
          f"({loaded.origin}), params sha256 {loaded.params_sha256[:16]}..., to {output}: {', '.join(files)}",
          flush=True)
    if args.push_to_hub:
        message = args.commit_message or f"p2p_diloco run {cfg.run.run_id}{epoch}"
        try:
            url = push_folder(output, args.push_to_hub, private=args.private, commit_message=message)
        except Exception as e:  # noqa: BLE001 - hub, network and auth errors: one line, the folder stays
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"{PROG}: error: cannot push to {args.push_to_hub!r}: {first}. The folder {output} is complete; "
                  "log in (huggingface-cli login or HF_TOKEN) and push again", file=sys.stderr)
            return 1
        print(f"pushed to https://huggingface.co/{args.push_to_hub}: {url}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
