"""Config: flags, env and files map onto the same dataclasses; bad values are one clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from p2p_diloco.cli.common import make_parser
from p2p_diloco.config import TrainConfig, default_eval_every
from p2p_diloco.config_loader import ConfigError, build, field_docstrings


def _build(argv: list[str], env: dict[str, str] | None = None, config_file: str | None = None) -> TrainConfig:
    parser = make_parser("t", "t", TrainConfig)
    return build(TrainConfig, parser.parse_args(argv), config_file, environ=env or {})


def test_defaults_and_flags_map_onto_fields() -> None:
    cfg = _build(["--inner-lr", "0.002", "--outer-lr", "0.5", "--outer-momentum", "0.8", "--batch-size", "8",
                  "--seq-len", "64", "--run-id", "abc", "--compression", "int8", "--local-steps", "20"])
    assert cfg.inner.lr == 0.002 and cfg.outer.lr == 0.5 and cfg.outer.momentum == 0.8
    assert cfg.inner.batch_size == 8 and cfg.model.seq_len == 64 and cfg.run.run_id == "abc"
    assert cfg.outer.compression == "int8" and cfg.outer.local_steps == 20
    assert _build([]).model.model == "tiny"
    # crediting what a sparse reply drops is on unless turned off, for swarm and simulator alike
    assert _build([]).outer.credit_undelivered and not _build(["--credit-undelivered", "false"]).outer.credit_undelivered
    from p2p_diloco.config import OuterConfig

    with pytest.raises(ValueError, match="credit_undelivered: must be true or false"):
        OuterConfig(credit_undelivered="false")  # type: ignore[arg-type]  # a string would be truthy


def test_the_learning_rate_decays_over_the_rounds_the_run_will_train() -> None:
    """--max-rounds R: R rounds of H steps, or R fragment rounds of H / F steps with --fragments F."""
    assert _build(["--max-rounds", "10", "--local-steps", "20"]).inner.total_steps == 200
    assert _build(["--max-rounds", "10", "--local-steps", "20", "--fragments", "4"]).inner.total_steps == 50
    assert _build(["--max-rounds", "10", "--local-steps", "20", "--total-steps", "7"]).inner.total_steps == 7
    # the default evaluation cadence keeps its cost share: F times as many (shorter) rounds between evaluations
    plain = _build(["--local-steps", "20"]).run.eval_every
    assert _build(["--local-steps", "20", "--fragments", "4"]).run.eval_every == default_eval_every(5, 8) > plain


def test_precedence_file_then_env_then_flags(tmp_path) -> None:
    toml = tmp_path / "peer.toml"
    toml.write_text('[inner]\nlr = 0.003\nbatch_size = 4\n[model]\nseq_len = 32\n')
    cfg = _build([], env={}, config_file=str(toml))
    assert (cfg.inner.lr, cfg.inner.batch_size, cfg.model.seq_len) == (0.003, 4, 32)
    cfg = _build([], env={"P2P_DILOCO_INNER_LR": "0.004"}, config_file=str(toml))
    assert cfg.inner.lr == 0.004 and cfg.inner.batch_size == 4
    cfg = _build(["--inner-lr", "0.005"], env={"P2P_DILOCO_INNER_LR": "0.004"}, config_file=str(toml))
    assert cfg.inner.lr == 0.005
    yaml_file = tmp_path / "peer.yaml"
    yaml_file.write_text("outer:\n  local_steps: 7\n  min_local_steps: 2\n")
    assert _build([], config_file=str(yaml_file)).outer.local_steps == 7


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--inner-lr", "5"], {}, "--inner-lr (inner.lr): must be in (0.0, 1.0]"),
        (["--inner-lr", "-1"], {}, "--inner-lr"),
        (["--batch-size", "0"], {}, "--batch-size (inner.batch_size): must be in [1, 65536]"),
        (["--micro-batch-size", "3", "--batch-size", "8"], {}, "divide batch_size=8"),
        (["--seq-len", "4"], {}, "--seq-len"),
        (["--outer-momentum", "1.5"], {}, "--outer-momentum"),
        (["--local-steps", "0"], {}, "--local-steps"),
        (["--run-id", "bad id!"], {}, "--run-id"),
        (["--resume"], {}, "needs checkpoint_dir"),
        (["--metrics-port", "70000"], {}, "--metrics-port"),
        (["--device", "gpu9"], {}, "--device"),
        (["--batch-size", "many"], {}, "cannot read 'many' as int"),
        ([], {"P2P_DILOCO_INNER_LR": "fast"}, "$P2P_DILOCO_INNER_LR"),
    ],
)
def test_bad_values_name_the_field(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        _build(argv, env=env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_config_file(tmp_path) -> None:
    bad = tmp_path / "x.toml"
    bad.write_text("[inner]\nlr = \n")
    with pytest.raises(ConfigError, match="is not valid"):
        _build([], config_file=str(bad))
    unknown = tmp_path / "y.yaml"
    unknown.write_text("inner:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown key 'inner.learning_rate'"):
        _build([], config_file=str(unknown))
    with pytest.raises(ConfigError, match="does not exist"):
        _build([], config_file=str(tmp_path / "missing.toml"))


def test_every_field_is_documented() -> None:
    from p2p_diloco import config as c

    for cls in (c.ModelConfig, c.DataConfig, c.InnerConfig, c.OuterConfig, c.RunConfig):
        docs = field_docstrings(cls)
        missing = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_cli_usage_error_is_one_line_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "p2p_diloco.cli.train_local", "--max-rounds", "1", "--inner-lr", "7"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--inner-lr" in lines[0] and "Traceback" not in proc.stderr
