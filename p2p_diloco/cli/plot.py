"""``run_peer plot LOGFILE... --output run.png``: the peers' JSON-lines round logs as one picture.

Four panels, one line per log file (each peer writes its own with ``--log-file``):

- loss against wall-clock time: the round's mean training loss (solid) and the held-out loss (dots);
- the same against the tokens this peer trained on (inner steps x batch size x sequence length, read from
  the log's ``start`` record);
- outcomes per round: how many peers ended each epoch's round averaged, folded late work, resynced,
  skipped or applied their own term only (stacked), the first thing to look at when loss stalls;
- traffic and utilization: megabytes sent + received per round (bars) and the share of each round's
  wall-clock time spent training (line, right axis; 100% means the network cost nothing).

matplotlib draws it (``pip install matplotlib``; the ``dev`` and ``tracking`` extras include it).
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p_diloco.cli.common import Parser, usage_error
from p2p_diloco.core.rounds import Outcome
from p2p_diloco.peer.runlog import read_records

PROG = "run_peer plot"
OUTCOME_COLORS = {Outcome.AVERAGED.value: "tab:green", Outcome.FOLDED_LATE.value: "tab:blue",
                  Outcome.RESYNCED.value: "tab:orange", Outcome.OWN_ONLY.value: "tab:purple",
                  Outcome.SKIPPED.value: "tab:red"}


@dataclass
class PeerLog:
    """What one log file holds, as plot-ready series."""

    name: str
    rounds: list[dict[str, Any]] = field(default_factory=list)
    round_tokens: list[int] = field(default_factory=list)
    evals: list[tuple[float, int, float]] = field(default_factory=list)
    """(time, cumulative tokens, eval loss) of every evaluation, the initial one included."""
    round_wall: list[float | None] = field(default_factory=list)
    """Wall-clock seconds of each round (from the previous round or the initial evaluation)."""


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_log(path: Path) -> PeerLog:
    """Parse one ``--log-file``; raises ``ValueError`` naming the file and line of a malformed record."""
    log = PeerLog(path.stem)
    tokens_per_step, tokens, last_time = 0, 0, None
    if not path.exists():
        raise ValueError(f"cannot read {path}: No such file or directory")
    for number, record in enumerate(read_records(path), 1):
        if _number(record.get("time")) is None:
            raise ValueError(f"{path}: record {number} is not a run_peer log record (no event time)")
        event, when = record.get("event"), float(record["time"])
        if event == "start":
            config = record.get("config") or {}
            try:
                tokens_per_step = int(config["inner"]["batch_size"]) * int(config["model"]["seq_len"])
                tokens_per_step *= max(1, int(record.get("node_ranks") or 1))  # a node: every rank's batch
            except (KeyError, TypeError, ValueError):
                tokens_per_step = 0
            last_time = when
        elif event == "eval" and _number(record.get("eval_loss")) is not None:
            log.evals.append((when, tokens, float(record["eval_loss"])))
            last_time = when
        elif event == "round":
            tokens += int(_number(record.get("inner_steps")) or 0) * tokens_per_step
            log.rounds.append(record)
            log.round_tokens.append(tokens)
            log.round_wall.append(when - last_time if last_time is not None else None)
            last_time = when
            if _number(record.get("eval_loss")) is not None:
                log.evals.append((when, tokens, float(record["eval_loss"])))
    return log


def draw(logs: list[PeerLog], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min([r["time"] for log in logs for r in log.rounds] + [e[0] for log in logs for e in log.evals])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (by_time, by_tokens), (outcomes, traffic) = axes
    for i, log in enumerate(logs):
        color = f"C{i % 10}"
        minutes = [(r["time"] - t0) / 60 for r in log.rounds]
        train = [_number(r.get("train_loss")) for r in log.rounds]
        by_time.plot(minutes, [float("nan") if v is None else v for v in train], color=color,
                     label=f"{log.name} train")
        by_tokens.plot(log.round_tokens, [float("nan") if v is None else v for v in train], color=color,
                       label=f"{log.name} train")
        if log.evals:
            by_time.plot([(e[0] - t0) / 60 for e in log.evals], [e[2] for e in log.evals], "o:", color=color,
                         markersize=4, label=f"{log.name} eval")
            by_tokens.plot([e[1] for e in log.evals], [e[2] for e in log.evals], "o:", color=color, markersize=4,
                           label=f"{log.name} eval")
        megabytes = [((_number(r.get("bytes_sent")) or 0) + (_number(r.get("bytes_received")) or 0)) / 1e6
                     for r in log.rounds]
        width = 0.8 / len(logs)
        traffic.bar([k + i * width for k in range(len(megabytes))], megabytes, width=width, color=color, alpha=0.5,
                    label=f"{log.name} MB")
    by_time.set(xlabel="minutes", ylabel="loss (nats/token)", title="loss against time")
    by_tokens.set(xlabel="tokens trained on (this peer)", ylabel="loss (nats/token)", title="loss against tokens")
    for ax in (by_time, by_tokens):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    counts: dict[int, Counter[str]] = defaultdict(Counter)
    for log in logs:
        for r in log.rounds:
            counts[int(_number(r.get("epoch")) or 0)][str(r.get("outcome"))] += 1
    epochs = sorted(counts)
    bottom = [0] * len(epochs)
    names = [o for o in OUTCOME_COLORS if any(counts[e][o] for e in epochs)]
    names += sorted({o for e in epochs for o in counts[e]} - set(OUTCOME_COLORS))
    for name in names:
        heights = [counts[e][name] for e in epochs]
        outcomes.bar(epochs, heights, bottom=bottom, color=OUTCOME_COLORS.get(name, "tab:gray"), label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    outcomes.set(xlabel="epoch of the round", ylabel="peers", title="round outcomes")
    outcomes.legend(fontsize=7)

    util_ax = traffic.twinx()
    for i, log in enumerate(logs):
        util = [100 * r["inner_seconds"] / wall if wall and _number(r.get("inner_seconds")) is not None else None
                for r, wall in zip(log.rounds, log.round_wall, strict=True)]
        util_ax.plot(range(len(util)), [float("nan") if u is None else min(u, 100.0) for u in util], "s-",
                     color=f"C{i % 10}", markersize=3, label=f"{log.name} utilization")
    util_ax.set(ylabel="utilization (% of round spent training)", ylim=(0, 105))
    traffic.set(xlabel="round (this peer)", ylabel="MB sent + received", title="traffic and utilization")
    traffic.legend(fontsize=7, loc="upper left")
    util_ax.legend(fontsize=7, loc="upper right")
    from matplotlib.ticker import MaxNLocator

    for ax in (outcomes, traffic):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="Draw peers' JSON-lines round logs (run_peer --log-file) as a PNG.")
    parser.add_argument("logs", nargs="+", metavar="LOGFILE", help="JSON-lines logs, one per peer")
    parser.add_argument("-o", "--output", default="rounds.png", help="the PNG to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    logs = []
    for name in args.logs:
        path = Path(name)
        if not path.is_file():
            usage_error(PROG, f"log file {name!r} does not exist; pass the files run_peer --log-file wrote")
        try:
            logs.append(read_log(path))
        except ValueError as e:
            usage_error(PROG, str(e))
    if not any(log.rounds for log in logs):
        usage_error(PROG, f"no round records in {', '.join(args.logs)}; plot the log of a peer that finished a round")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        usage_error(PROG, "plotting needs matplotlib: pip install matplotlib (or 'p2p-diloco[tracking]')")
    output = Path(args.output)
    draw([log for log in logs if log.rounds], output)
    print(f"wrote {output}: {sum(len(log.rounds) for log in logs)} rounds from {len(logs)} log(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
