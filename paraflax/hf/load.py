"""`load_hf`: a local Hugging Face checkpoint directory -> a paraflax `Transformer`.

The module is built abstractly (`nnx.eval_shape`, no weights allocated), every expected
tensor is checked against the safetensors headers (names, shapes and dtypes against
config.json, byte ranges against the file; before any data is read), and then each parameter
is filled from its tensor one at a time, refusing non-finite and absurd values, so host memory peaks
near the converted model plus one tensor. Hugging Face directories carry no checksums: these
checks are what can be verified, and each error names the tensor and its file.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from paraflax.hf import layout
from paraflax.hf.config import model_config_from_hf, read_hf_config
from paraflax.hf.safetensors_io import TensorInfo, is_float, read_header, read_tensor
from paraflax.json_io import json_field, read_json_object
from paraflax.model.config import ModelConfig
from paraflax.model.transformer import Transformer

INDEX = "model.safetensors.index.json"
_LIST = 8  # names shown in an error before "and N more"
_BLOCK = 1 << 22  # elements checked at once by check_values
_IMPLAUSIBLE = 1e30
_FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16")


def _names(names) -> str:
  names = sorted(names)
  more = f" and {len(names) - _LIST} more" if len(names) > _LIST else ""
  return ", ".join(names[:_LIST]) + more


def safetensors_index(path: str | os.PathLike) -> dict[str, TensorInfo]:
  """Tensor name -> TensorInfo over `model.safetensors` or the shards of the index."""
  path = Path(path)
  if (path / INDEX).is_file():
    weight_map = json_field(path / INDEX, read_json_object(path / INDEX), "weight_map", dict)
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


def check_dtypes(saved: str | None, entries, index: dict[str, TensorInfo]) -> None:
  """Raise naming the first weight that is not floating point, or whose dtype is not the
  `saved` one of config.json (`torch_dtype`; None: any float)."""
  for e in entries:
    info = index[e.hf_name]
    if not is_float(info.dtype) or saved is not None and info.dtype.name != saved:
      want = saved or "a floating-point dtype"
      raise ValueError(f"{info.file}: tensor {e.hf_name!r} is {info.dtype.name}, expected {want}"
                       " (config.json)")


def check_values(x: np.ndarray, name: str, info: TensorInfo) -> None:
  """Raise naming the tensor when `x` holds a NaN, an infinity, or a magnitude above 1e30
  (no trained weight comes near it; one flipped high exponent bit of a float32 or bfloat16
  weight lands there). Checked in blocks: the masks cost megabytes, not a tensor's worth."""
  flat = x.reshape(-1)
  bounded = float(ml_dtypes.finfo(x.dtype).max) > _IMPLAUSIBLE
  for lo in range(0, flat.size, _BLOCK):
    block = flat[lo:lo + _BLOCK]
    ok = np.isfinite(block)
    if bounded:
      ok &= np.abs(block) <= _IMPLAUSIBLE
    if not ok.all():
      first = lo + int(np.argmin(ok))
      kind = "an implausible" if np.isfinite(flat[first]) else "a non-finite"
      raise ValueError(f"{info.file}: tensor {name!r} holds {kind} value ({flat[first]} at "
                       f"index {[int(i) for i in np.unravel_index(first, x.shape)]}): the file "
                       "is corrupt")


def load_hf(path: str | os.PathLike, *, dtype: str | None = None,
            param_dtype: str | None = None, max_seq_len: int | None = None) -> Transformer:
  """A paraflax `Transformer` with the weights of a local Hugging Face checkpoint.

  path: a directory with `config.json` and `model.safetensors` (or shards + index) of a
  Llama, Qwen2/Qwen2.5 or Qwen3 model. `dtype` (compute) defaults to the checkpoint's dtype,
  `param_dtype` to `dtype`; `max_seq_len` to `max_position_embeddings`.
  """
  path = Path(path).expanduser()
  hf_cfg = read_hf_config(path)
  cfg = model_config_from_hf(hf_cfg, dtype=dtype, param_dtype=param_dtype,
                             max_seq_len=max_seq_len)
  index = safetensors_index(path)
  graphdef, params = abstract_model(cfg)
  entries = plan(cfg, params)
  check_tensors(cfg, [e for e, _ in entries], index, path)
  saved = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")
  check_dtypes(saved if saved in _FLOAT_NAMES else None, [e for e, _ in entries], index)
  target = np.dtype(cfg.params_dtype)
  with contextlib.ExitStack() as stack:
    files = {}
    for e, var in entries:
      info = index[e.hf_name]
      if info.file not in files:
        files[info.file] = stack.enter_context(open(info.file, "rb"))
      raw = read_tensor(files[info.file], info)
      check_values(raw, e.hf_name, info)
      x = layout.to_paraflax(raw, e)
      del raw
      # one tensor on the host at a time: cast (no-op when dtypes agree), hand to the device
      var.set_value(jax.device_put(np.ascontiguousarray(x.astype(target, copy=False))))
      del x
  return nnx.merge(graphdef, params)
