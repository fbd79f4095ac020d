"""AS-ARM continual training of your own Hugging Face model on your records, for ASSD (any-
subset speculative decoding) and infilling: the two-stream model (one new query-stream vector)
on the lattice objective, masking rates ~ U[0.05, 0.99]. Not exportable to Hugging Face (no
two-stream architecture there): bench it with `paraflax bench --asarm-workdir runs/asarm`.

    paraflax train --config hf/asarm --workdir runs/asarm --hf ~/models/qwen2.5-0.5b \\
        --data train.jsonl
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  base = load_config(Path(__file__).with_name("sft.py"))
  return dataclasses.replace(
      base,
      model=dataclasses.replace(base.model, two_stream=True),
      data=dataclasses.replace(base.data, seq_len=1024),
      objective="asarm",
      objective_args={"rate_start": [0.05, 0.99], "rate_end": [0.05, 0.99], "ramp_steps": 1},
  )
