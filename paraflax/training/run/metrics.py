"""The run's metrics log (`metrics.jsonl`) and loss curve (`loss.png`).

One JSON object per line: training entries carry `loss` (with `step`, `lr`, `tokens_per_s`,
`batch_fingerprint`, ...), validation entries carry `val_loss`. On resume the log is cut
back to the restored step, so it always reads like one uninterrupted run. Both files go
through `etils.epath` (a `gs://` workdir works); on object stores, which cannot append, each
entry rewrites the log.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
from etils import epath

from paraflax.json_io import append_text, write_atomic

METRICS = "metrics.jsonl"
LOSS_PLOT = "loss.png"


def read_metrics(path: str | os.PathLike) -> list[dict]:
  """All complete entries (a line cut short by a kill is skipped)."""
  path = epath.Path(path)
  if path.is_dir():
    path = path / METRICS
  if not path.is_file():
    return []
  entries = []
  for line in path.read_text().splitlines():
    try:
      entries.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return entries


class MetricsLog:
  """Append-only JSONL log; on open, keeps only entries with `step <= resume_step`.

  `resume_step=0` (a fresh start) empties it.
  """

  def __init__(self, path: str | os.PathLike, resume_step: int = 0):
    self.path = epath.Path(path)
    kept = [e for e in read_metrics(self.path) if 0 < resume_step and e["step"] <= resume_step]
    write_atomic(self.path, "".join(json.dumps(e) + "\n" for e in kept))

  def write(self, entry: dict) -> None:
    append_text(self.path, json.dumps(entry) + "\n")  # a killed process keeps every line


def batch_fingerprint(tokens_BxL) -> int:
  """A cheap, order-sensitive checksum of a batch: sum(tokens * fixed weights).

  The weights depend only on the batch shape, so equal fingerprints across runs mean the
  same batch; logging one per step exposes lost or repeated batches after a resume.
  """
  tokens = np.asarray(tokens_BxL, np.int64)
  weights = np.arange(tokens.size, dtype=np.int64).reshape(tokens.shape) % 7919 + 1
  return int((tokens * weights).sum())


def plot_losses(workdir: str | os.PathLike) -> epath.Path:
  """Write `<workdir>/loss.png`: training loss and validation loss against step."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global backend
  from matplotlib.figure import Figure

  workdir = epath.Path(workdir)
  entries = read_metrics(workdir / METRICS)
  train = [(e["step"], e["loss"]) for e in entries if "loss" in e]
  val = [(e["step"], e["val_loss"]) for e in entries if "val_loss" in e]
  fig = Figure(figsize=(6, 4), dpi=100)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  if train:
    ax.plot(*zip(*train), label="train", lw=1)
  if val:
    ax.plot(*zip(*val), "o-", label="validation", ms=3)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png")
  write_atomic(workdir / LOSS_PLOT, png.getvalue())
  return workdir / LOSS_PLOT
