"""Jacobi Forcing, round 2 (progressive distillation): block-32 trajectories collected from the
round-1 model, trained from it.

    paraflax collect-trajectories --workdir runs/jf_r1 \\
        --out ~/.cache/paraflax/jf/r2_trajectories --block-size 32 --num-blocks 2 --examples 2048
    paraflax train --config jacobi_forcing_r2 --workdir runs/jf_r2

Noise window 8 as in the paper (section 4.1, block 32): levels 0, 1/8, ..., 7/8.
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  return dataclasses.replace(
      load_config(Path(__file__).with_name("jacobi_forcing_r1.py")),
      init_from="runs/jf_r1",
      data_source_args={"path": "~/.cache/paraflax/jf/r2_trajectories", "noise_window": 8},
  )
