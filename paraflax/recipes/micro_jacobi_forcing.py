"""Seconds-scale Jacobi Forcing run for tests: `micro_ar.py`'s model distilled on trajectories
(set `init_from`, `data_source_args.path` and `data.seq_len`, the store's packed row length,
with `--set`)."""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  return dataclasses.replace(
      load_config(Path(__file__).with_name("micro_ar.py")),
      init_from="runs/micro_ar",
      data_source="trajectories",
      data_source_args={"path": "runs/micro_trajectories", "noise_window": 2,
                        "val_fraction": 0.25},
      objective="jacobi_forcing",
      steps=6,
      eval_every=3,
      checkpoint_every=3,
  )
