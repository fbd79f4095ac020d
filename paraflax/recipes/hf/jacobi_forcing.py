"""Jacobi Forcing on your own Hugging Face model: distil it on its own greedy Jacobi
trajectories from your records' prompts (paper section 4.1: block 16, noise window 16).

    paraflax collect-trajectories --hf ~/models/qwen2.5-0.5b --data train.jsonl \\
        --out runs/jf_store --block-size 16 --num-blocks 8 --max-prompt-len 256 --examples 4096
    paraflax train --config hf/jacobi_forcing --workdir runs/jf \\
        --hf ~/models/qwen2.5-0.5b --set data_source_args.path=runs/jf_store

The rows of the store are max_prompt_len + 2 x num_blocks x block_size = 512 tokens
(`data.seq_len`; a store of other rows is refused: set both together). A second round
collects from the first round's workdir (`--workdir runs/jf`) with a larger block.
"""

import dataclasses
from pathlib import Path

from paraflax.training.config.train import TrainConfig, load_config


def get_config() -> TrainConfig:
  base = load_config(Path(__file__).with_name("sft.py"))
  return dataclasses.replace(
      base,
      data=dataclasses.replace(base.data, seq_len=512),
      data_source="trajectories",
      data_source_args={"path": "runs/jf_store", "noise_window": 16},
      objective="jacobi_forcing",
      objective_args={"ar_weight": 10.0, "temperature": 1.0},
  )
