"""The classic speculative-decoding baseline's drafter: a small AR model of the DEER drafter's
size (410k params, same shapes) trained from scratch on the same teacher store with the same
number of supervised target tokens (positions that carry a loss) as DEER's Stage I + Stage II:
next-token loss on the answer tokens only (objective "ar" on teacher rows), so every row gives
exactly `ANSWER_LEN` targets and the steps follow from DEER's count.

    paraflax teacher-data --workdir checkpoints/tiny_ar --out ~/.cache/paraflax/deer/teacher \\
        --examples 8192 --answer-len 128
    paraflax train --config ar_drafter --workdir runs/ar_drafter
Measured on 2 CPU cores shared with two other training jobs: 1033 steps took 15.5 min (~5 min
alone, from the earlier 3000 steps in 14 min); validation loss 8.09 -> 0.92 (the earlier
3000-step drafter, 2.9x DEER's targets, reached 0.58).
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config

# DEER's supervised targets, exactly (`objectives.deer.supervised_targets` of each stage's
# config replays both runs' batches and keys; docs/methods/speculative.md): Stage I's masked
# suffix slots (2000 steps x 16 rows, ~32 a row) + Stage II's R masks (1000 steps x 16 rows x
# 8 blocks, ~8.5 a block)
DEER_TARGETS = 1_028_637 + 1_086_965
ANSWER_LEN = 128  # the teacher store's answer tokens: the targets of one "ar" row


def get_config() -> TrainConfig:
  stage1 = load_config(Path(__file__).with_name("deer_drafter_stage1.py"))
  return dataclasses.replace(
      stage1,
      model=dataclasses.replace(stage1.model, mask_token_id=None, sep_token_id=None),
      objective="ar",
      steps=round(DEER_TARGETS / (stage1.data.batch_size * ANSWER_LEN)),  # 1033
  )
