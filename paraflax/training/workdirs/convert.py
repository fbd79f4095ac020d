"""`convert_hf`: a Hugging Face checkpoint -> a directory `paraflax.training.load_trained` reads.

Layout written (what `load_trained` expects):
    config.json      a TrainConfig dump whose `model` is the converted ModelConfig (its `data`
                     part is a placeholder: nothing was trained on it)
    tokenizer.json   the checkpoint's tokenizer
    hf_config.json   the source config.json, for provenance
    generation_config.json, tokenizer_config.json  its roles: every EOS id, PAD, BOS, the
                     chat template (`Tokenizer.save`; `Tokenizer.load(out)` reads them back)
    checkpoints/0/   the params as an orbax pytree (item `params`, no optimizer state), with
                     their checksums (`checksums.process_0.json`)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
from flax import nnx

from paraflax import destination
from paraflax.data.pipeline import DataConfig
from paraflax.hf.config import read_hf_config
from paraflax.hf.load import load_hf
from paraflax.hf.tokenizer import load_hf_tokenizer
from paraflax.training.config.train import TrainConfig
from paraflax.training.workdirs.checkpoint import CHECKPOINTS, write_manifest


def convert_hf(src: str | os.PathLike, out: str | os.PathLike, *, dtype: str | None = None,
               max_seq_len: int | None = None, overwrite: bool = False) -> dict:
  """Convert `src` into `out`; return a summary dict with keys out, n_params, seconds.

  As `export_hf`: `out` must be absent or empty, or `overwrite` given (an earlier convert
  output, say); never a training workdir, a store or `src`, nor inside or around one; the
  directory appears whole (`destination.replacing`)."""
  t0 = time.perf_counter()
  src = Path(src).expanduser()
  hf_cfg = read_hf_config(src)
  tokenizer = load_hf_tokenizer(src)  # load_trained needs one: fail before the slow part
  out = destination.check_output(out, overwrite=overwrite, source=src)
  model = load_hf(src, dtype=dtype, max_seq_len=max_seq_len)
  cfg = model.cfg
  data = DataConfig(seq_len=max(2, min(256, cfg.max_seq_len)),
                    vocab_size=min(tokenizer.vocab_size, cfg.vocab_size))
  train_cfg = TrainConfig(model=cfg, data=data, steps=1)
  with destination.replacing(out) as tmp:
    _write(tmp, train_cfg, hf_cfg, tokenizer, model)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return {"out": str(out), "n_params": n_params, "seconds": time.perf_counter() - t0}


def _write(out: Path, train_cfg, hf_cfg: dict, tokenizer, model) -> None:
  """The files of the module docstring into the directory `out`."""
  import orbax.checkpoint as ocp

  (out / "config.json").write_text(json.dumps(train_cfg.to_dict(), indent=2) + "\n")
  (out / "hf_config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
  tokenizer.save(out)  # with its roles, so that export writes every EOS id back
  _, params = nnx.split(model, nnx.Param)
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  # orbax copies every array while writing; capping bytes in flight at the largest tensor
  # keeps the peak near one model instead of two
  largest = max(x.nbytes for x in jax.tree.leaves(params))
  handler = ocp.StandardCheckpointHandler(save_concurrent_gb=(largest + 2**20) / 1e9)
  with ocp.CheckpointManager(out / CHECKPOINTS, options=options,
                             item_handlers={"params": handler}) as mngr:
    mngr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True)
    mngr.wait_until_finished()
  write_manifest(out / CHECKPOINTS / "0")
