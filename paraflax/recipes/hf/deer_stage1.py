"""DEER drafter, Stage I, for your own Hugging Face verifier: a diffusion drafter (here a
smaller checkpoint of the same tokenizer, e.g. Qwen2.5-0.5B for a 7B verifier) distilled on
the verifier's greedy answers to your records' prompts. The drafter gains `<mask>` and `<sep>`.

    paraflax teacher-data --hf ~/models/qwen2.5-7b --data train.jsonl --out runs/deer_store \\
        --max-prompt-len 256 --answer-len 256 --examples 8192
    paraflax train --config hf/deer_stage1 --workdir runs/deer1 \\
        --hf ~/models/qwen2.5-0.5b --set data_source_args.path=runs/deer_store

Rows are max_prompt_len + answer_len = 512 tokens (`data.seq_len`). Stage II:
`hf/deer_stage2`.
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  base = load_config(Path(__file__).with_name("sft.py"))
  return dataclasses.replace(
      base,
      model=dataclasses.replace(base.model, mask_token_id=2, sep_token_id=3),  # ids from --hf
      data=dataclasses.replace(base.data, seq_len=512),
      data_source="teacher",
      data_source_args={"path": "runs/deer_store", "val_fraction": 0.02},
      objective="deer_stage1",
      objective_args={},
  )
