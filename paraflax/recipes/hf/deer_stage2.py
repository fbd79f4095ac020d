"""DEER drafter, Stage II: Stage I's drafter refined on decode-like blocks (Eq. 6 weights).

    paraflax train --config hf/deer_stage2 --workdir runs/deer2 \\
        --hf runs/deer1 --set data_source_args.path=runs/deer_store
    paraflax generate --hf ~/models/qwen2.5-7b --decoder deer --draft runs/deer2 --prompt ...

`--hf` names Stage I's workdir (made from an HF dir): the model, its tokenizer (with
`<mask>`/`<sep>`) and its weights are Stage I's.
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  base = load_config(Path(__file__).with_name("deer_stage1.py"))
  return dataclasses.replace(
      base,
      objective="deer_stage2",
      objective_args={"max_masked": 16, "alpha": 1.06, "blocks": 8},
  )
