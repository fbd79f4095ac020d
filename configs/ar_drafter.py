"""The classic speculative-decoding baseline's drafter: a small AR model of the DEER drafter's
size (410k params, same shapes) trained from scratch on the same teacher store for the same
total steps as DEER's Stage I + Stage II, next-token loss on the answer tokens only (objective
"ar" on teacher rows: the same supervision as the DEER drafter, the teacher's continuations).

    paraflax teacher-data --workdir checkpoints/tiny_ar --out ~/.cache/paraflax/deer/teacher \\
        --examples 8192 --answer-len 128
    paraflax train --config configs/ar_drafter.py --workdir runs/ar_drafter
Measured on 2 CPU cores: 3000 steps take 14 min; validation loss 8.09 -> 0.58 (teacher-forced
answer-token accuracy ~0.85).
"""

import dataclasses
from pathlib import Path

from paraflax.training.config import TrainConfig, load_config


def get_config() -> TrainConfig:
  stage1 = load_config(Path(__file__).with_name("deer_drafter_stage1.py"))
  stage2 = load_config(Path(__file__).with_name("deer_drafter.py"))
  return dataclasses.replace(
      stage1,
      model=dataclasses.replace(stage1.model, mask_token_id=None, sep_token_id=None),
      objective="ar",
      steps=stage1.steps + stage2.steps,
  )
