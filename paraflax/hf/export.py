"""`export_hf`: a paraflax model -> a Hugging Face directory other engines can serve.

The architecture follows the config (Qwen3 if qk-norm, Qwen2 if q/k/v bias, else Llama).
Tensors are converted and written one at a time in the params' own dtype, so
`load_hf(export_hf(load_hf(d)))` has bit-identical parameters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from flax import nnx

from paraflax.data.tokenizer import Tokenizer
from paraflax.hf import layout
from paraflax.hf.config import hf_config_from_model
from paraflax.hf.safetensors_io import write_safetensors

WEIGHTS = "model.safetensors"


def _write_json(file: Path, obj) -> None:
  file.write_text(json.dumps(obj, indent=2) + "\n")


def export_hf(model, out_dir: str | os.PathLike, tokenizer: Tokenizer | None = None) -> Path:
  """Write `config.json`, `model.safetensors` (and `tokenizer.json` and
  `generation_config.json` when `tokenizer` is given) into `out_dir`; return it."""
  cfg = model.cfg
  ids = {}
  if tokenizer is not None:
    ids = dict(eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  hf_cfg = hf_config_from_model(cfg, **ids)  # raises before anything is written
  out = Path(out_dir).expanduser()
  out.mkdir(parents=True, exist_ok=True)
  _, params = nnx.split(model, nnx.Param)
  tensors = []
  for path, var in nnx.to_flat_state(params):
    e = layout.entry(path, var.shape)
    tensors.append((e.hf_name, e.hf_shape, np.dtype(var.dtype),
                    lambda var=var, e=e: layout.to_hf(np.asarray(var.get_value()), e)))
  tensors.sort(key=lambda t: t[0])
  write_safetensors(out / WEIGHTS, tensors)
  stale = out / "model.safetensors.index.json"  # an old sharded export would shadow ours
  if stale.exists():
    stale.unlink()
  _write_json(out / "config.json", hf_cfg)
  if tokenizer is not None:
    tokenizer.save(out / "tokenizer.json")
    gen = {k: v for k, v in (("eos_token_id", tokenizer.eos_id),
                             ("pad_token_id", tokenizer.pad_id)) if v is not None}
    _write_json(out / "generation_config.json", gen)
  return out
