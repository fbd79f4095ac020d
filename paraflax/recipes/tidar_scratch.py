"""TiDAR from scratch: `tiny_ar.py`'s model, data and schedule, trained with the "tidar"
objective from random weights (alpha = 1, block sizes 4, 8, 16 drawn per row).

    paraflax train --config tidar_scratch --workdir runs/tidar_scratch

Each step costs ~2-4x an AR step (the doubled sequence), so expect ~1 h on 2 CPU cores.
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  base = load_config(Path(__file__).with_name("tiny_ar.py"))
  return dataclasses.replace(
      base,
      model=dataclasses.replace(base.model, mask_token_id=2),
      objective="tidar",
      objective_args={"block_size": [4, 8, 16], "alpha": 1.0},
  )
