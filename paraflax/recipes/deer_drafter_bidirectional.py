"""DEER drafter, Stage II, with a bidirectional prefix, from the bidirectional Stage I run: the
recipe of `deer_drafter.py` but one block per row. A bidirectional prefix is encoded
differently after each cut, so a row's blocks cannot share its clean tokens (`stage2_rows`
gives each block its own row): 8 blocks per row would cost ~5x the causal Stage II step.
One block per row costs about a causal Stage I step and trains 1/8 of the causal Stage II
targets per step, so 8000 steps give as many supervised targets as the causal drafter's
Stage II (1000 steps x 8 blocks): 27 min on 2 quiet cores.

    paraflax train --config deer_drafter_bidirectional_stage1 \\
        --workdir runs/deer_bidirectional_stage1
    paraflax train --config deer_drafter_bidirectional \\
        --workdir runs/deer_bidirectional
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  causal = load_config(Path(__file__).with_name("deer_drafter.py"))
  return dataclasses.replace(
      causal, model=dataclasses.replace(causal.model, drafter_prefix="bidirectional"),
      init_from="runs/deer_bidirectional_stage1",
      objective_args={**dict(causal.objective_args), "blocks": 1}, steps=8 * causal.steps)
