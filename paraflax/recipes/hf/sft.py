"""AR supervised fine-tuning of your own Hugging Face model on your JSON Lines records: loss on
the responses (prompt/response and chat records, under the model's chat template when it has
one; `--set data_source_args.loss_on=all` for every token), every token of text records.

    paraflax train --config hf/sft --workdir runs/sft --hf ~/models/qwen2.5-0.5b \\
        --data train.jsonl [--data more.jsonl]

`--hf` replaces the placeholder model below by the checkpoint's architecture, weights and
tokenizer (`paraflax/training/config/from_hf.py`); `--data` replaces the data files. Sized for one
80 GB GPU at 0.5B-1.5B: 8 rows of 2048 tokens per step, bfloat16 compute on float32 weights,
rematerialisation on (auto). Larger models: `--set mesh=(1,-1,1)` (FSDP over every device),
`--set grad_accum=4` (4 micro-batches per step). The other `hf/` recipes start here.
"""

import dataclasses
from pathlib import Path

from paraflax.data.pipeline import DataConfig
from paraflax.training.config.train import OptimConfig, TrainConfig, load_config


def get_config() -> TrainConfig:
  base = load_config(Path(__file__).parents[1] / "tiny_ar.py")  # the model: a placeholder
  return dataclasses.replace(
      base,
      model=dataclasses.replace(base.model, max_seq_len=4096, dtype="bfloat16",
                                param_dtype="float32"),
      data=DataConfig(seq_len=2048, batch_size=8),
      data_source="jsonl",
      data_source_args={"paths": ["train.jsonl"], "val_fraction": 0.02, "loss_on": "response"},
      optim=OptimConfig(peak_lr=1e-5, warmup_steps=20, end_lr_fraction=0.1, weight_decay=0.0),
      steps=1000,
      eval_every=100,
      eval_batches=8,
      checkpoint_every=200,
      keep_checkpoints=1,
  )
