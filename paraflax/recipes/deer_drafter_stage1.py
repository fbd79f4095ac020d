"""DEER drafter, Stage I (AR-style continuation distillation): a block-diffusion drafter of
410k params (d_model 64, 3 layers; `tiny_ar.py` has 1.31M; same 2048-token vocabulary, <mask> 2,
<sep> 3) trained from scratch on the shipped tiny AR model's greedy answers (objective
"deer_stage1": cut each answer, insert <sep>, mask the rest of the answer at a per-row rate t,
1/t-weighted masked-diffusion loss).

    paraflax teacher-data --workdir checkpoints/tiny_ar --out ~/.cache/paraflax/deer/teacher \\
        --examples 8192 --answer-len 128
    paraflax train --config deer_drafter_stage1 --workdir runs/deer_stage1

Stage II: `deer_drafter`; the small-AR-drafter baseline: `ar_drafter`.
Measured on 2 CPU cores shared with another job: the teacher store (8192 prompts of 32-96
tokens, 128-token answers) takes ~4 min; 2000 steps of 16 rows take 12 min (~3.8 steps/s when
the cores are free); validation loss 7.99 -> 2.48.
"""

from paraflax.data.pipeline import DataConfig
from paraflax.model.config import ModelConfig
from paraflax.training.config.train import OptimConfig, TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      model=ModelConfig(vocab_size=2048, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                        d_ff=192, max_seq_len=512, mask_token_id=2, sep_token_id=3),
      # seq_len: the teacher store's row length, max_prompt_len 96 + answer_len 128 (a store
      # of other rows is refused); the objectives add <sep> and the blocks
      data=DataConfig(seq_len=224, batch_size=16, vocab_size=2048),
      data_source="teacher",  # the teacher store made by the command above
      data_source_args={"path": "~/.cache/paraflax/deer/teacher", "val_fraction": 0.05},
      objective="deer_stage1",
      optim=OptimConfig(peak_lr=3e-3, warmup_steps=100, end_lr_fraction=0.1, weight_decay=0.1),
      steps=2000,
      eval_every=250,
      eval_batches=8,
      checkpoint_every=250,
      keep_checkpoints=1,
      log_every=10,
  )
