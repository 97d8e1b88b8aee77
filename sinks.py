"""Live views of a run beside metrics.jsonl, chosen by a config's `report_to`: TensorBoard event
files (torch's SummaryWriter) in OUT/tensorboard, a Weights & Biases run in OUT/wandb. Both are
optional packages, imported only when a config names them. A sink gets the numbers of each record
metrics.jsonl gets, under the same keys, at the record's `step`; config.MetricsWriter feeds them."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# sink -> the package it imports (pip install <package>)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def taken_folder(names, out_dir) -> str | None:
    """One line naming the first sink in `names` whose folder in `out_dir` (OUT/tensorboard,
    OUT/wandb) is taken by a file, else None: said when the config is read, not after the model
    has loaded."""
    for name in names:
        folder = Path(out_dir) / name
        if folder.exists() and not folder.is_dir():
            return (
                f"{name} writes into {folder}, a file there: move it or choose another output_dir"
            )
    return None


def missing_package(names) -> str | None:
    """One line naming the first sink in `names` whose package is not installed, else None."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            return f"{name} needs the {PACKAGES[name]} package (pip install {PACKAGES[name]})"
    return None


class TensorBoardSink:
    """TensorBoard event files; the events of steps from `first_step` on, which a resumed run logs
    again, are purged (SummaryWriter's purge_step), so no step shows twice."""

    def __init__(self, out_dir: Path, run_config: dict, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=first_step)

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run per process start: a resumed run is a new W&B run, which logs again the steps
    after the checkpoint (the killed run's W&B run keeps them; docs/configs.md). The project is
    WANDB_PROJECT (default clue-mini); WANDB_MODE=offline writes only the local folder. The run's
    config is the resolved config with secrets removed; W&B reads its key from WANDB_API_KEY."""

    def __init__(self, out_dir: Path, run_config: dict, first_step: int):
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "clue-mini"),
            name=out_dir.resolve().name,
            dir=str(out_dir),
            config=run_config,
        )

    def log(self, values: dict, step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


_SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


def open_sinks(names, out_dir, run_config: dict, first_step: int = 1) -> list:
    """The sinks `names` asks for, writing under `out_dir`, the next step logged `first_step`;
    `run_config` must hold no secret."""
    return [_SINKS[name](Path(out_dir), run_config, first_step) for name in dict.fromkeys(names)]
