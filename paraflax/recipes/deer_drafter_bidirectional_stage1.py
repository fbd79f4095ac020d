"""DEER drafter, Stage I, with a bidirectional prefix (`ModelConfig.drafter_prefix`): the
recipe of `deer_drafter_stage1.py` (same data, steps, keys and targets), but every prefix token
sees the whole prefix. The decoder then re-encodes the prefix at every draft (no drafter
cache); the setting travels with the weights in config.json.

    paraflax train --config deer_drafter_bidirectional_stage1 \\
        --workdir runs/deer_bidirectional_stage1
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  causal = load_config(Path(__file__).with_name("deer_drafter_stage1.py"))
  return dataclasses.replace(
      causal, model=dataclasses.replace(causal.model, drafter_prefix="bidirectional"))
