"""TiDAR continual training of your own Hugging Face model on your records: the doubled row
[clean | all-mask copy], block sizes 4, 8 and 16 drawn per row (alpha = 1). The model gains a
`<mask>` token (a new id whose rows start at the mean embedding), or reuses a reserved one:
`--set data.mask_token='<|fim_pad|>'` (Qwen ships unused special tokens).

    paraflax train --config hf/tidar --workdir runs/tidar --hf ~/models/qwen2.5-0.5b \\
        --data train.jsonl

A doubled row costs about 2x an AR row: 1024 clean tokens per row here.
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  base = load_config(Path(__file__).with_name("sft.py"))
  return dataclasses.replace(
      base,
      model=dataclasses.replace(base.model, mask_token_id=2),  # needed: --hf sets the id
      data=dataclasses.replace(base.data, seq_len=1024),
      objective="tidar",
      objective_args={"block_size": [4, 8, 16], "alpha": 1.0},
  )
