"""Jacobi Forcing, round 1: distil the shipped tiny AR model on its own block-16 trajectories.

    paraflax collect-trajectories --workdir checkpoints/tiny_ar \\
        --out ~/.cache/paraflax/jf/r1_trajectories --block-size 16 --num-blocks 4 --examples 2048
    paraflax train --config jacobi_forcing_r1 --workdir runs/jf_r1

Noise window 16 as in the paper (section 4.1, block 16): Eq. 7's levels 0, 1/16, ..., 15/16, so
one block in 16 is its own fixed point and the noisiest are as unconverged (~15/16) as the
blocks Jacobi decoding meets. Round 2 (`jacobi_forcing_r2`) collects block-32
trajectories from this model.
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import OptimConfig, TrainConfig, load_config


def get_config() -> TrainConfig:
  base = load_config(Path(__file__).with_name("tiny_ar.py"))
  return dataclasses.replace(
      base,
      init_from="checkpoints/tiny_ar",
      # the packed row length of the store above: max_prompt_len 96 + 2 x 4 blocks x 16 (round
      # 2's 2 blocks of 32 give the same); a store of other rows is refused
      data=dataclasses.replace(base.data, seq_len=224),
      data_source="trajectories",  # the store made by the command above
      data_source_args={"path": "~/.cache/paraflax/jf/r1_trajectories", "noise_window": 16},
      objective="jacobi_forcing",
      objective_args={"ar_weight": 10.0, "temperature": 1.0},
      optim=OptimConfig(peak_lr=5e-4, warmup_steps=20, end_lr_fraction=0.1, weight_decay=0.1),
      steps=600,
      eval_every=100,
      checkpoint_every=100,
  )

