"""tools/plots.py: the training-curve figure (Figure 5) and F1 against reasoning tokens (Figure 4),
their panels and labels, and the command line's refusals (`python -m tools.plots`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fake_eval

from tools import plots

REPO = Path(__file__).resolve().parents[2]


def plots_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tools.plots", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


@pytest.mark.slow
def test_figures_are_written_with_labelled_axes(tmp_path):
    pytest.importorskip("matplotlib")
    evals = [
        fake_eval("Base Qwen", 0.40, 0.50, 900, 800),
        fake_eval("Reasoning SFT", 0.43, 0.48, 500, 450),
        fake_eval("CLUE", 0.47, 0.55, 400, 350),
    ]
    plots.plot_f1_vs_tokens(evals, tmp_path / "f1.png")
    run = tmp_path / "grpo-run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(40):
            record = {
                "step": step,
                "reward": 0.5 + step / 100,
                "reward_std": 0.2,
                "rewards/accuracy/mean": step / 50,
                "rewards/iu/mean": 0.3,
                "completions/mean_length": 900 - 10 * step,
                "kl": 0.001 * step,
                "groups/masked": step % 3,
                "lr": 1e-6 * min(1, step / 5),
                "loss": "nan" if step == 7 else 0.1,
                "eval/ccu_emotion/macro_f1": 0.3 + step / 200,
                "eval/ccu_norm/macro_f1": 0.5,
            }
            f.write(json.dumps(record) + "\n")
        f.write('{"step": 40, "rew')  # a torn last line
    other = tmp_path / "acc-only"
    other.mkdir()
    (other / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward": 0.4, "lr": 1e-6}) + "\n" for s in range(30))
    )
    panels = plots.plot_training_curves([run, other], tmp_path / "curves.png")
    cli = plots_cli("curves", str(run))
    evals_dir = tmp_path / "evals"
    for i, e in enumerate(evals):
        (evals_dir / str(i)).mkdir(parents=True)
        (evals_dir / str(i) / "eval.json").write_text(json.dumps(e))
    f1_cli = plots_cli(
        "f1", *(str(evals_dir / str(i)) for i in range(3)), "--out", str(tmp_path / "f1b")
    )
    assert f1_cli.returncode == 0 and (tmp_path / "f1b.png").stat().st_size > 10_000, f1_cli.stderr
    assert cli.returncode == 0 and (run / "training_curves.png").is_file(), cli.stderr
    assert panels == [
        "Mean reward",
        "Reward components",
        "Completion length",
        "KL to reference",
        "Masked groups",
        "Learning rate",
        "Loss",
        "Eval macro F1",
    ]
    assert (tmp_path / "f1.png").stat().st_size > 10_000 and (
        tmp_path / "curves.png"
    ).stat().st_size > 10_000


def test_missing_matplotlib_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plots.PlotUnavailable, match="requirements-plot.txt"):
        plots.pyplot()


def test_no_figure_says_why_a_set_without_a_domain_has_none(tmp_path):
    """An ECF-style evaluation whose one set has no domain (in or out): the F1 figure plots the
    domains' averages, so none is drawn; the line says that, not that reasoning tokens were not
    counted, and the command exits 1 (it did not do its job)."""
    evaluation = fake_eval("ECF", 0.4, 0.5, 300, 300)
    evaluation["averages"] = {}
    (tmp_path / "eval.json").write_text(json.dumps(evaluation))
    drawn = plots_cli("f1", str(tmp_path), "--out", str(tmp_path / "f1.png"))
    assert drawn.returncode == 1 and not (tmp_path / "f1.png").exists()
    assert "no figure: no set has a domain (in or out), whose averages it plots" in drawn.stderr
    assert "no reasoning-token counts" not in drawn.stderr


def test_curve_panels_keep_steps_and_updates_apart_and_bands_inside_the_rewards_seen():
    sft = [{"step": s, "loss": 2.0 / s, "lr": 1e-4} for s in range(1, 41)]
    grpo = [
        {"step": 1, "loss": 0.0, "lr": 1e-6, "reward": 0.1, "reward_std": 0.3,
         "reward_min": 0.0, "reward_max": 0.6},
        {"step": 2, "loss": 0.0, "lr": 1e-6, "reward": 0.9, "reward_std": 0.3,
         "reward_min": 0.5, "reward_max": 1.0},
    ]  # fmt: skip
    panels = plots.curve_panels([("sft", sft), ("grpo", grpo)])
    assert [(p.title, p.xlabel) for p in panels] == [
        ("Mean reward", "GRPO update"),
        ("Learning rate (SFT)", "SFT step"),
        ("Learning rate (GRPO)", "GRPO update"),
        ("Loss (SFT)", "SFT step"),
        ("Loss (GRPO)", "GRPO update"),
    ]
    (reward,) = panels[0].series
    assert reward.steps == (1, 2)
    # mean ± SD, never past the update's lowest or highest reward: 0.1 - 0.3 stops at 0.0, 0.9 + 0.3
    # at 1.0
    assert [v for band in reward.band for v in band] == pytest.approx([0.0, 0.4, 0.6, 1.0])
    sft_loss = panels[3].series[0]
    assert not sft_loss.marker and panels[4].series[0].marker  # 40 points: a line; 2: dots
    # one GRPO run alone: no suffix, as before
    assert [p.title for p in plots.curve_panels([("grpo", grpo)])][-1] == "Loss"


def test_plot_refuses_to_replace_a_figure_and_asks_where_several_runs_go(tmp_path):
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        runs.append(str(tmp_path / name))
    (tmp_path / "a" / "training_curves.png").write_bytes(b"earlier figure")

    def plot(*args):
        return plots_cli("curves", *args)

    replace = plot(runs[0])
    assert replace.returncode == 2 and "--overwrite" in replace.stderr, replace.stderr
    assert (tmp_path / "a" / "training_curves.png").read_bytes() == b"earlier figure"
    several = plot(*runs)
    assert several.returncode == 2 and "--out" in several.stderr, several.stderr
    assert not (tmp_path / "b" / "training_curves.png").exists()


def test_f1_figure_labels_coinciding_points_once_and_keeps_f1_in_its_range():
    marks = [("Base", 400.0, 0.0), ("SFT", 400.0, 0.0), ("CLUE", 350.0, 0.0)]
    assert plots.point_labels(marks) == [("Base, SFT", 400.0, 0.0), ("CLUE", 350.0, 0.0)]
    assert plots.f1_limits(-0.06, 0.06) == (0.0, 10.0)  # all F1 zero: a readable 0-10% axis
    assert plots.f1_limits(35.0, 62.0) == (35.0, 62.0)
    assert plots.f1_limits(-3.0, 104.0) == (0.0, 100.0)


def metrics_run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    return folder


@pytest.mark.parametrize(
    "out, mine, expected",
    [
        ("fig", "fig.png", "fig.png exists; pass --overwrite to replace it"),
        ("curves.txt", None, "--out {tmp}/curves.txt: the figure is a PNG; name a .png file"),
        ("figs", "figs/", "--out {tmp}/figs.png is a folder"),
    ],
)
def test_plot_checks_the_name_it_will_write_before_drawing(tmp_path, capsys, out, mine, expected):
    """`--out fig` writes fig.png (matplotlib adds the suffix), so the user's fig.png is kept
    without --overwrite (was: replaced, the tool naming `fig`); `--out curves.txt` is one line (was
    matplotlib's ValueError traceback); a folder of that name is refused before drawing."""
    pytest.importorskip("matplotlib")
    run = metrics_run(tmp_path / "run")
    if mine == "figs/":
        (tmp_path / "figs.png").mkdir()
    elif mine:
        (tmp_path / mine).write_bytes(b"my figure")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as stop:
        plots.main(["curves", str(run), "--out", str(tmp_path / out)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and expected.format(tmp=tmp_path) in error, error
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    if mine == "fig.png":
        assert (tmp_path / "fig.png").read_bytes() == b"my figure"
        plots.main(["curves", str(run), "--out", str(tmp_path / "fig"), "--overwrite"])
        assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {tmp_path / 'fig.png'} (" in capsys.readouterr().out
