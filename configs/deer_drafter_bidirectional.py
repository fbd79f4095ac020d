"""DEER drafter, Stage II, with a bidirectional prefix: the recipe of `deer_drafter.py` from
the bidirectional Stage I run. A bidirectional prefix is encoded differently after each cut, so
the 8 blocks of a row cannot share its clean tokens: each gets its own row (`stage2_rows`),
~5x the slots of the causal Stage II step.

    paraflax train --config configs/deer_drafter_bidirectional_stage1.py \\
        --workdir runs/deer_bidirectional_stage1
    paraflax train --config configs/deer_drafter_bidirectional.py \\
        --workdir runs/deer_bidirectional
"""

import dataclasses
from pathlib import Path

from paraflax.training.config import TrainConfig, load_config


def get_config() -> TrainConfig:
  causal = load_config(Path(__file__).with_name("deer_drafter.py"))
  return dataclasses.replace(
      causal, model=dataclasses.replace(causal.model, drafter_prefix="bidirectional"),
      init_from="runs/deer_bidirectional_stage1")
