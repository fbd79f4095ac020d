"""Resumable stores of int32 arrays written batch by batch with tensorstore (zarr), made by a
model from prompts of the training split: the Jacobi trajectory store (`trajectories.py`) and
the DEER teacher store (`teacher.py`).

A store is a directory:
    meta.json       the settings it was made with (`examples`, `batch_size`, ...): a store made
                    with other settings is refused, never mixed
    tokenizer.json  the tokenizer of the model that made it
    progress.json   {"batches": k}: the first k batches are on disk (filling resumes there)
    <name>/         one zarr int32 array per name, `[examples, ...]`, chunked by batch
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import tensorstore as ts
from tqdm.auto import tqdm

from paraflax.training.interrupt import Interrupted
from paraflax.training.trainer import write_json

META, PROGRESS, TOKENIZER = "meta.json", "progress.json", "tokenizer.json"


def training_prompts(tokens: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
  """`cfg.examples` random windows of a token stream: (prompts [N, P] right-padded, lengths).

  `cfg`: any config with `examples`, `min_prompt_len`, `max_prompt_len` (P) and `seed`.
  """
  rng = np.random.default_rng(cfg.seed)
  need = cfg.max_prompt_len + 1
  if len(tokens) < need:
    raise ValueError(f"the token stream has {len(tokens)} tokens, fewer than one prompt")
  lens = rng.integers(cfg.min_prompt_len, cfg.max_prompt_len + 1, cfg.examples)
  starts = rng.integers(0, len(tokens) - need, cfg.examples)
  prompts = np.zeros((cfg.examples, cfg.max_prompt_len), np.int32)
  for i, (s, n) in enumerate(zip(starts, lens)):
    prompts[i, :n] = tokens[s:s + n]
  return prompts, lens.astype(np.int32)


def open_array(path: Path, name: str, shape=None, chunk=None, *, create: bool = False):
  """The zarr int32 array `path/name`: opened, or created empty (replacing any old one)."""
  spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path / name)}}
  if create:
    spec["metadata"] = {"shape": list(shape), "chunks": list(chunk), "dtype": "<i4"}
    return ts.open(spec, create=True, delete_existing=True).result()
  return ts.open(spec, open=True).result()


def num_batches(meta: Mapping) -> int:
  return -(-meta["examples"] // meta["batch_size"])


def open_store(out: Path, meta: dict, shapes: Mapping[str, tuple], tokenizer, *,
               what: str) -> tuple[dict, int]:
  """(arrays by name, batches already on disk) of the store at `out`.

  A partial or complete store made with the same `meta` is reopened (to resume); a store
  made with other settings is refused; anything else starts afresh: empty arrays of
  `shapes[name] = (shape, chunk)`, meta.json, tokenizer.json and progress 0.
  """
  done = 0
  if (out / META).is_file() and (out / PROGRESS).is_file():
    old = json.loads((out / META).read_text())
    if old != meta:
      diff = sorted(k for k in set(meta) | set(old) if old.get(k) != meta.get(k))
      raise ValueError(f"{str(out)!r} holds a {what} made with other settings "
                       f"({', '.join(diff)}); use a fresh directory")
    done = json.loads((out / PROGRESS).read_text())["batches"]
  if done:
    return {k: open_array(out, k) for k in shapes}, done
  out.mkdir(parents=True, exist_ok=True)
  arrays = {k: open_array(out, k, *shapes[k], create=True) for k in shapes}
  write_json(out / META, meta)
  tokenizer.save(out / TOKENIZER)
  write_json(out / PROGRESS, {"batches": 0})
  return arrays, 0


def padded_batch(a: np.ndarray, lo: int, hi: int, size: int) -> np.ndarray:
  """Rows lo..hi of `a`, the last one repeated up to `size` rows (one compiled shape)."""
  return np.concatenate([a[lo:hi], np.repeat(a[hi - 1:hi], size - (hi - lo), 0)])


def fill(out: Path, arrays: Mapping, meta: Mapping, done: int,
         make: Callable[[int, int, int], Mapping[str, np.ndarray]], *, desc: str,
         progress: bool = True, postfix: Callable[[Mapping], dict] | None = None) -> None:
  """Write batches `done..` : `make(i, lo, hi)` returns rows lo..hi of every array. progress.json
  advances only after a batch is on disk, so a killed fill resumes at the first unwritten one."""
  total, bs = num_batches(meta), meta["batch_size"]
  bar = tqdm(total=total, initial=done, desc=desc, unit="batch", disable=not progress,
             dynamic_ncols=True)
  try:
    for i in range(done, total):
      lo, hi = i * bs, min((i + 1) * bs, meta["examples"])
      rows = make(i, lo, hi)
      for w in [arrays[k][lo:hi].write(v) for k, v in rows.items()]:
        w.result()
      write_json(out / PROGRESS, {"batches": i + 1})  # only after the data is on disk
      bar.update(1)
      if postfix is not None:
        bar.set_postfix(**postfix(rows))
  except KeyboardInterrupt:  # Ctrl-C: what progress.json says is on disk is kept
    kept = json.loads((out / PROGRESS).read_text())["batches"]
    raise Interrupted(f"interrupted: {kept} of {total} batches are kept in {out}; run the "
                      "same command again to resume") from None
  finally:
    bar.close()


def read_store(path: str | os.PathLike, names, *, what: str,
               command: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(meta, arrays by name) of a complete store; refuses a missing or unfinished one."""
  path = Path(path).expanduser()
  if not (path / META).is_file():
    raise FileNotFoundError(f"no {what} at {str(path)!r} (make one with `paraflax {command}`)")
  meta = json.loads((path / META).read_text())
  total = num_batches(meta)
  done = json.loads((path / PROGRESS).read_text())["batches"] if (path / PROGRESS).is_file() else 0
  if done < total:
    raise ValueError(f"{what} {str(path)!r} is incomplete ({done}/{total} batches): rerun "
                     f"`paraflax {command}` with the same settings to finish it")
  return meta, {k: np.asarray(open_array(path, k).read().result()) for k in names}
