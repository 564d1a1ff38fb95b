"""Per-step metrics (log, CSV, TensorBoard) and the end-of-run report (loss curve PNG + summary)."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_core.run_records import EVAL_COLUMNS, STEP_COLUMNS  # the one column definition
from training.flops import PEAK_BF16_TFLOPS

if TYPE_CHECKING:
    from training.tracking import Tracker

log = logging.getLogger(__name__)


def peak_tflops(configured: float | None) -> float | None:
    if configured is not None:
        return configured
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


class MetricsLog:
    """Rank-0 sink: appends one CSV row per step (kept across resumes) and TensorBoard scalars."""

    def __init__(self, csv_path: Path, tb_dir: Path | None, tracker: Tracker | None = None):
        self.csv_path = csv_path
        self.tracker = tracker  # MLflow (training/tracking.py): gets every row written, off the step's path
        self.eval_path = csv_path.with_name("eval.csv")
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = read_csv(csv_path) if csv_path.exists() else []
        self.eval_rows: list[dict[str, Any]] = read_csv(self.eval_path) if self.eval_path.exists() else []
        self._tb = None
        if tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tb_dir))
            except ImportError:  # tensorboard is optional
                log.info("tensorboard not installed; CSV only")

    def truncate(self, last_step: int) -> None:
        """Drop rows after the restored checkpoint (steps that are about to be redone)."""
        self.rows = [r for r in self.rows if int(r["step"]) <= last_step]
        self.eval_rows = [r for r in self.eval_rows if int(r["step"]) <= last_step]
        _write(self.csv_path, STEP_COLUMNS, self.rows)
        _write(self.eval_path, EVAL_COLUMNS, self.eval_rows)

    def add(self, row: dict[str, Any], eta_s: float | None = None) -> None:
        row = {k: row.get(k) for k in STEP_COLUMNS}
        self.rows.append(row)
        _append(self.csv_path, STEP_COLUMNS, row)
        if self.tracker is not None:
            self.tracker.log_step(row)
        if self._tb is not None:
            for k in STEP_COLUMNS[1:]:
                if row[k] is not None:
                    self._tb.add_scalar(f"train/{k}", float(row[k]), int(row["step"]))
        log.info("step %d loss %s lr %.3g grad_norm %s tokens/s %.1f%s%s%s", row["step"], row["loss"], row["lr"],
                 _fmt(row["grad_norm"]), row["tokens_per_s"],
                 "" if row["mfu"] is None else f" mfu {row['mfu']:.3f}",
                 "" if eta_s is None else f" eta {_duration(eta_s)}", " SKIPPED" if row["skipped"] else "")
        if row["reward_accuracy"] is not None:
            log.info("step %d dpo: reward accuracy %.3f margin %.4f chosen %.4f rejected %.4f (%d pairs)", row["step"],
                     row["reward_accuracy"], row["reward_margin"], row["chosen_reward"], row["rejected_reward"],
                     row["pairs"])

    def add_eval(self, row: dict[str, Any]) -> None:
        row = {k: row.get(k) for k in EVAL_COLUMNS}
        self.eval_rows.append(row)
        _append(self.eval_path, EVAL_COLUMNS, row)
        if self.tracker is not None:
            self.tracker.log_eval(row)
        if self._tb is not None:
            for k in EVAL_COLUMNS[1:]:
                if row[k] is not None and k not in ("eval_micro_batches", "eval_target_tokens"):
                    self._tb.add_scalar(f"eval/{k.removeprefix('eval_')}", float(row[k]), int(row["step"]))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _write(path: Path, fields, rows) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def _append(path: Path, fields, row) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerow(row)


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [{k: _parse(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _parse(v: str):
    if v in ("", "None"):
        return None
    try:
        return int(v)
    except ValueError:
        return float(v)


def write_report(out_dir: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """loss_curve.png + summary.json next to metrics.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows:
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    if summary.get("eval_loss") is not None and rows:
        ax.axhline(summary["eval_loss"], color="tab:orange", linestyle="--", label="val loss (final)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "loss_curve.png", dpi=100)
    plt.close(fig)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=_json_default))


def _json_default(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return str(v)
