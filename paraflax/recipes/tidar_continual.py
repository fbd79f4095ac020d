"""TiDAR continual pretraining: the shipped tiny AR model (`checkpoints/tiny_ar`) trained on
the doubled sequence [clean | all-mask copy] (objective "tidar", alpha = 1), with block sizes
4, 8 and 16 drawn per row so one model drafts at every block size the bench uses.

    paraflax train --config tidar_continual --workdir runs/tidar_continual

The parameter shapes are the AR model's (TiDAR adds no weights; mask id 2 is the tokenizer's
reserved <mask>). A doubled row costs ~3x an AR row per token: ~2k clean tokens/s on 2 quiet
CPU cores, so 400 steps of 16 x 256 take ~14 minutes (36 minutes measured while another
training job shared the cores). Training on does not lower the diffusion loss: a 1600-step
schedule stopped by the plateau rule at step 500 ends at the same diffusion loss with a worse
AR mode (docs/methods/tidar.md).
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import OptimConfig, TrainConfig, load_config


def get_config() -> TrainConfig:
  return dataclasses.replace(
      load_config(Path(__file__).with_name("tidar_scratch.py")),  # the model and objective
      init_from="checkpoints/tiny_ar",
      optim=OptimConfig(peak_lr=2e-3, warmup_steps=30, end_lr_fraction=0.1, weight_decay=0.1),
      steps=400,
      eval_every=100,
      checkpoint_every=100,
  )
