"""Seconds-scale AR run for tests: a micro model on a dozen stdlib files."""

from paraflax.data.pipeline import DataConfig
from paraflax.model.config import ModelConfig
from paraflax.training.config.train import OptimConfig, TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      model=ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=64),
      data=DataConfig(seq_len=64, batch_size=8, vocab_size=320, max_files=12),
      optim=OptimConfig(peak_lr=1e-2, warmup_steps=5, weight_decay=0.0),
      steps=40,
      eval_every=10,
      eval_batches=4,
      checkpoint_every=10,
      keep_checkpoints=2,
      log_every=1,
  )
