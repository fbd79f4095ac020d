"""Seconds-scale Jacobi Forcing run for tests: `micro_ar.py`'s model distilled on trajectories
(set `init_from` and `trajectories.path` with `--set`)."""

import dataclasses
from pathlib import Path

from paraflax.training.config import TrainConfig, load_config
from paraflax.training.jacobi_forcing import TrajectoryData


def get_config() -> TrainConfig:
  return dataclasses.replace(
      load_config(Path(__file__).with_name("micro_ar.py")),
      init_from="runs/micro_ar",
      trajectories=TrajectoryData(path="runs/micro_trajectories", noise_window=2,
                                  val_fraction=0.25),
      objective="jacobi_forcing",
      steps=6,
      eval_every=3,
      checkpoint_every=3,
  )
