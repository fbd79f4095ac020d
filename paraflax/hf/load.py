"""`load_hf`: a local Hugging Face checkpoint directory -> a paraflax `Transformer`.

The module is built abstractly (`nnx.eval_shape`, no weights allocated), every expected
tensor is checked against the safetensors headers (names and shapes, before any data is
read), and then each parameter is filled from its tensor one at a time, so host memory peaks
near the converted model plus one tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from paraflax.config import ModelConfig
from paraflax.hf import layout
from paraflax.hf.config import model_config_from_hf, read_hf_config
from paraflax.hf.safetensors_io import TensorInfo, read_header, read_tensor
from paraflax.model import Transformer

INDEX = "model.safetensors.index.json"
_LIST = 8  # names shown in an error before "and N more"


def _names(names) -> str:
  names = sorted(names)
  more = f" and {len(names) - _LIST} more" if len(names) > _LIST else ""
  return ", ".join(names[:_LIST]) + more


def safetensors_index(path: str | os.PathLike) -> dict[str, TensorInfo]:
  """Tensor name -> TensorInfo over `model.safetensors` or the shards of the index."""
  path = Path(path)
  if (path / INDEX).is_file():
    weight_map = json.loads((path / INDEX).read_text()).get("weight_map", {})
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
      raise FileNotFoundError(f"{path}: shards named in {INDEX} are missing: {_names(missing)}")
  else:
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
      bins = sorted(p.name for p in path.glob("*.bin"))
      hint = f" (found {_names(bins)}: PyTorch pickles are not read; re-save with " \
             "safe_serialization=True)" if bins else ""
      raise FileNotFoundError(f"{path}: no *.safetensors weights{hint}")
  out: dict[str, TensorInfo] = {}
  for f in files:
    for name, info in read_header(path / f).items():
      if name in out:
        raise ValueError(f"{path}: tensor {name!r} is stored twice ({out[name].file.name} and "
                         f"{f})")
      out[name] = info
  return out


def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract params State) of `Transformer(cfg)`, allocating nothing."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def plan(cfg: ModelConfig, params) -> list[tuple[layout.Entry, nnx.Variable]]:
  """(entry, abstract variable) for every parameter of the abstract `params`."""
  return [(layout.entry(path, var.shape), var) for path, var in nnx.to_flat_state(params)]


def check_tensors(cfg: ModelConfig, entries, index: dict[str, TensorInfo], where) -> None:
  """Raise naming every missing, unexpected or wrongly shaped tensor."""
  expected = {e.hf_name: e for e in entries}
  missing = [n for n in expected if n not in index]
  extra = [n for n in index if n not in expected
           and not n.endswith(layout.IGNORED_SUFFIXES)
           and not (cfg.tie_embeddings and n == "lm_head.weight")]
  shapes = [f"{n} {list(index[n].shape)} (expected {list(e.hf_shape)})"
            for n, e in expected.items() if n in index and index[n].shape != e.hf_shape]
  problems = []
  if missing:
    problems.append(f"missing tensors: {_names(missing)}")
  if shapes:
    problems.append(f"tensors whose shape does not match config.json: {_names(shapes)}")
  if extra:
    problems.append(f"unexpected tensors (not part of a {cfg.n_layers}-layer model of this "
                    f"config): {_names(extra)}")
  if problems:
    raise ValueError(f"{where}: " + "; ".join(problems))


def load_hf(path: str | os.PathLike, *, dtype: str | None = None,
            param_dtype: str | None = None, max_seq_len: int | None = None) -> Transformer:
  """A paraflax `Transformer` with the weights of a local Hugging Face checkpoint.

  path: a directory with `config.json` and `model.safetensors` (or shards + index) of a
  Llama, Qwen2/Qwen2.5 or Qwen3 model. `dtype` (compute) defaults to the checkpoint's dtype,
  `param_dtype` to `dtype`; `max_seq_len` to `max_position_embeddings`.
  """
  path = Path(path).expanduser()
  cfg = model_config_from_hf(read_hf_config(path), dtype=dtype, param_dtype=param_dtype,
                             max_seq_len=max_seq_len)
  index = safetensors_index(path)
  graphdef, params = abstract_model(cfg)
  entries = plan(cfg, params)
  check_tensors(cfg, [e for e, _ in entries], index, path)
  target = np.dtype(cfg.params_dtype)
  with contextlib.ExitStack() as stack:
    files = {}
    for e, var in entries:
      info = index[e.hf_name]
      if info.file not in files:
        files[info.file] = stack.enter_context(open(info.file, "rb"))
      x = layout.to_paraflax(read_tensor(files[info.file], info), e)
      # one tensor on the host at a time: cast (no-op when dtypes agree), hand to the device
      var.set_value(jax.device_put(np.ascontiguousarray(x.astype(target, copy=False))))
      del x
  return nnx.merge(graphdef, params)
