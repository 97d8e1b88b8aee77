"""The figures of an evaluation and of training runs, drawn with matplotlib
(requirements-plot.txt; nothing else in the project needs it):

    python -m tools.plots curves RUN_DIR ... [--out FILE] [--overwrite]   # training curves (Fig. 5)
    python -m tools.plots f1 EVAL ... --out FILE [--overwrite]             # F1 vs tokens (Fig. 4)

`curves` reads each run's metrics.jsonl (SFT steps and GRPO updates on panels of their own); with
one run the figure goes to training_curves.png in its folder. `f1` reads evaluations' eval.json (or
their folders), a point per model and a panel per domain (in, out).
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from config import atomic_write_text, read_metrics
from evaluate import DOMAINS, EVAL_JSON, EvalError, load_eval


class PlotUnavailable(RuntimeError):
    pass


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; PlotUnavailable without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "matplotlib is needed for figures: pip install -r requirements-plot.txt"
        ) from None
    return plt


def save_png(fig, path, dpi: int) -> None:
    """`fig` as a PNG at `path`, rendered in memory and written whole (atomic_write_text), so a
    failure leaves nothing and never a part of a file; the figure is closed."""
    import io

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    atomic_write_text(path, buffer.getvalue())


def point_labels(marks: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """One label per place in a figure: (name, x, y) marks that coincide (to the figure's
    resolution) share a label, their names joined, so no two labels print over each other."""
    places: dict[tuple[float, float], list] = {}
    for name, x, y in marks:
        places.setdefault((round(x, 1), round(y, 2)), [[], x, y])[0].append(name)
    return [(", ".join(names), x, y) for names, x, y in places.values()]


def f1_limits(lo: float, hi: float, least: float = 10.0) -> tuple[float, float]:
    """The F1 axis (in %): at least `least` points wide around the data and inside 0-100."""
    if hi - lo < least:
        mid = (lo + hi) / 2
        lo, hi = mid - least / 2, mid + least / 2
    if hi - lo <= 100:
        shift = max(0.0, -lo) - max(0.0, hi - 100)
        lo, hi = lo + shift, hi + shift
    return max(lo, 0.0), min(hi, 100.0)


def plot_f1_vs_tokens(evals: list[dict], path) -> bool:
    """Figure 4: average weighted F1 against mean reasoning tokens per completion, a point per model
    (error bar: SD over runs), a panel per domain. False (nothing drawn) without both numbers."""
    points = {
        d: [
            (i, e["name"], a["reasoning_tokens"]["mean"], a["weighted_f1"])
            for i, e in enumerate(evals)
            if (a := e["averages"].get(d))
            and a["reasoning_tokens"]["mean"] is not None
            and a["weighted_f1"]["mean"] is not None
        ]
        for d in ("in", "out")
    }
    points = {d: p for d, p in points.items() if p}
    if not points:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.5), squeeze=False)
    for ax, (domain, marks) in zip(axes[0], points.items()):
        for i, name, x, f1 in marks:
            y, sd = 100 * f1["mean"], None if f1["sd"] is None else 100 * f1["sd"]
            ax.errorbar(x, y, yerr=sd, fmt="o", ms=8, capsize=4, color=f"C{i}", label=name)
        for label, x, y in point_labels([(n, x, 100 * f1["mean"]) for _, n, x, f1 in marks]):
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(7, 7), fontsize=9)
        ax.set(
            title=DOMAINS[domain],
            xlabel="Mean reasoning tokens per completion",
            ylabel="Average weighted F1 (%)",
        )
        ax.margins(0.25)
        ax.set_ylim(*f1_limits(*ax.get_ylim()))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    fig.tight_layout()
    save_png(fig, path, 150)
    return True


CURVES = (
    ("Mean reward", "reward", "reward"),
    ("Reward components", "reward", "rewards/*/mean"),
    # f is 1 without any tag: beside it, the share of completions that quote at all
    ("Grounding", "share", "completions/quoting"),
    ("Completion length", "tokens", "completions/mean_length"),
    ("KL to reference", "KL", "kl"),
    ("Masked groups", "groups", "groups/masked"),
    ("Learning rate", "LR", "lr"),
    ("Loss", "loss", "loss"),
    ("Eval macro F1", "macro F1", "eval/*/macro_f1"),
)
# a run that logs a reward counts GRPO updates, any other (SFT, a reward model) optimizer steps
UNITS = {True: ("GRPO update", "GRPO"), False: ("SFT step", "SFT")}
FEW_POINTS = 30  # a series with at most this many points is drawn with a dot on each


@dataclass
class Series:
    """One line of a panel; `band` (the mean reward's): (low, high) per step."""

    label: str
    color: str
    style: str
    steps: tuple
    values: tuple
    band: tuple | None = None

    @property
    def marker(self) -> str:
        return "o" if len(self.steps) <= FEW_POINTS else ""


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]


def reward_band(record: dict) -> tuple[float, float] | None:
    """The mean reward ± its SD across a group's members, never past the update's lowest or
    highest reward (older metrics.jsonl files without them: unclipped)."""
    mean, sd = record["reward"], record.get("reward_std")
    if mean is None or sd is None:
        return None
    low, high = record.get("reward_min"), record.get("reward_max")
    return (
        mean - sd if low is None else max(mean - sd, low),
        mean + sd if high is None else min(mean + sd, high),
    )


def curve_panels(runs: list[tuple[str, list[dict]]]) -> list[Panel]:
    """The panels of the training-curve figure for (run name, metrics records) pairs: a panel per
    quantity in CURVES that some run logged, and per x unit (SFT steps and GRPO updates are
    different things, so a quantity both kinds of run log gets a panel for each, its title
    suffixed); a colour per run (per component or task with one run)."""
    panels = []
    for title, ylabel, pattern in CURVES:
        keys = sorted(
            {k for _, recs in runs for r in recs for k in r if fnmatch.fnmatch(k, pattern)}
        )
        by_unit: dict[bool, list[Series]] = {}
        for i, (run, recs) in enumerate(runs):
            grpo = any("reward" in r for r in recs)
            for k, key in enumerate(keys):
                points = [r for r in recs if key in r and r[key] is not None]
                if not points:
                    continue
                part = key.split("/")[1] if "*" in pattern else ""  # the reward component or task
                label = f"{run}: {part}" if len(runs) > 1 and part else part or run
                color, style = (
                    (f"C{k}", "-") if len(runs) == 1 else (f"C{i}", ("-", "--", ":", "-.")[k % 4])
                )
                bands = [reward_band(r) for r in points] if key == "reward" else [None]
                by_unit.setdefault(grpo, []).append(
                    Series(
                        label,
                        color,
                        style,
                        tuple(r["step"] for r in points),
                        tuple(r[key] for r in points),
                        None if None in bands else tuple(bands),
                    )
                )
        for grpo, series in by_unit.items():
            xlabel, kind = UNITS[grpo]
            named = f"{title} ({kind})" if len(by_unit) > 1 else title
            panels.append(Panel(named, xlabel, ylabel, series))
    return panels


def plot_training_curves(run_dirs: list, path) -> list[str]:
    """Figure 5: the training curves of runs (their metrics.jsonl) as one PNG, the panels of
    `curve_panels` (mean reward with its band, each reward component, completion length, KL,
    masked groups, LR, loss, evaluation macro F1). Returns the panels' titles."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    runs = []
    for d in map(Path, run_dirs):
        file = d / "metrics.jsonl" if d.is_dir() else d
        if not file.is_file():
            raise EvalError(f"{file}: no metrics.jsonl")
        runs.append((d.name if d.is_dir() else d.parent.name, read_metrics(file)))
    panels = curve_panels(runs)
    if not panels:
        raise EvalError("none of the runs logged a quantity to plot")
    cols, rows = min(3, len(panels)), math.ceil(len(panels) / 3)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for line in panel.series:
            ax.plot(
                line.steps,
                line.values,
                line.style,
                color=line.color,
                label=line.label,
                lw=1.2,
                marker=line.marker,
                ms=3,
            )
            if line.band is not None:
                low, high = zip(*line.band)
                ax.fill_between(line.steps, low, high, color=line.color, alpha=0.15)
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    save_png(fig, path, 120)
    return [panel.title for panel in panels]


def png_path(parser, out, overwrite: bool) -> Path:
    """`--out` as the PNG to write: .png added to a name without a suffix (the name matplotlib
    would give it); a folder, another suffix or an existing file without `overwrite` refused."""
    out = Path(out)
    out = out if out.suffix else out.with_suffix(".png")
    if out.suffix.lower() != ".png":
        parser.error(f"--out {out}: the figure is a PNG; name a .png file")
    if out.is_dir():
        parser.error(f"--out {out} is a folder; name the .png file to write")
    if out.exists() and not overwrite:
        parser.error(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.plots", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    curves = commands.add_parser("curves", help="training curves from metrics.jsonl (Figure 5)")
    curves.add_argument("runs", nargs="+", help="run folders holding metrics.jsonl (or the files)")
    curves.add_argument(
        "--out",
        help="PNG to write (default with one run: training_curves.png in its folder; several "
        "runs need it)",
    )
    f1 = commands.add_parser("f1", help="average weighted F1 against reasoning tokens (Figure 4)")
    f1.add_argument("evals", nargs="+", help="eval.json files (or the folders holding them)")
    f1.add_argument("--out", required=True, help="PNG to write")
    for command in (curves, f1):
        command.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "curves":
            if args.out is None and len(args.runs) > 1:
                curves.error("several runs: say where their figure goes with --out FILE.png")
            first = Path(args.runs[0])
            default = (first if first.is_dir() else first.parent) / "training_curves.png"
            out = png_path(curves, args.out or default, args.overwrite)
            panels = plot_training_curves(args.runs, out)
            print(f"wrote {out} ({', '.join(panels)})")
            return
        out = png_path(f1, args.out, args.overwrite)
        paths = [Path(p) / EVAL_JSON if Path(p).is_dir() else Path(p) for p in args.evals]
        evals = [load_eval(p) for p in paths]
        if not plot_f1_vs_tokens(evals, out):
            why = (
                "no reasoning-token counts (an endpoint's evaluation needs 'tokenizer')"
                if any(e["averages"] for e in evals)
                else "no set has a domain (in or out), whose averages it plots"
            )
            print(f"error: no figure: {why}", file=sys.stderr)
            raise SystemExit(1)
        print(f"wrote {out}")
    except (EvalError, PlotUnavailable, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
