"""Tiny AR code model (1.3M params) on the standard-library corpus.

The demo ships the checkpoint this config makes (`checkpoints/tiny_ar/`); reproduce it with
    paraflax demo --retrain      (or: paraflax train --config tiny_ar --workdir DIR)
Measured on 2 CPU cores: ~7k tokens/s, so 2000 steps of 16 x 256 tokens take ~20 minutes.
"""

from paraflax.data.pipeline import DataConfig
from paraflax.model.config import ModelConfig
from paraflax.training.config.train import OptimConfig, TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      model=ModelConfig(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                        d_ff=384, max_seq_len=512),
      data=DataConfig(seq_len=256, batch_size=16, vocab_size=2048),
      optim=OptimConfig(peak_lr=3e-3, warmup_steps=100, end_lr_fraction=0.1, weight_decay=0.1),
      steps=2000,
      eval_every=250,
      eval_batches=8,
      checkpoint_every=250,
      keep_checkpoints=1,
      log_every=10,
  )
