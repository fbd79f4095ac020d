"""`export_hf`: a paraflax model -> a Hugging Face directory other engines can serve.

The architecture follows the config (Qwen3 if qk-norm, Qwen2 if q/k/v bias, else Llama).
Tensors are converted and written one at a time in the params' own dtype, so
`load_hf(export_hf(load_hf(d)))` has bit-identical parameters. With a tokenizer, the
directory is complete: `AutoModelForCausalLM` + `AutoTokenizer` + `generate` stop at EOS.

The directory is written whole into a temporary sibling and then takes the destination's
place (`paraflax.destination`): a non-empty destination needs `overwrite=True`, and a
paraflax workdir, a store or the model's own source is never written over.

One tokenizer everywhere: transformers 5 does not always read tokenizer.json as it is. For
some model types (Qwen2: `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` in its
`tokenization_auto.py`) `AutoTokenizer` ignores `tokenizer_class` and rebuilds the tokenizer
from the vocabulary and merges with that family's own normalizer and pre-tokenizer (Qwen2's
NFC and digit-splitting regex), which encodes a byte-level BPE trained with another
pre-tokenizer (paraflax's, or any user's) to other ids. An `auto_map` in
tokenizer_config.json is the one setting that bypasses it: `AutoTokenizer` then loads
`PreTrainedTokenizerFast` over tokenizer.json unchanged, and with `trust_remote_code=True` the
two-line class of `tokenization_paraflax.py` (the same thing) that the export writes beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from flax import nnx

from paraflax import destination
from paraflax.data.tokenizer import Tokenizer
from paraflax.hf import layout
from paraflax.hf.config import hf_config_from_model
from paraflax.hf.safetensors_io import write_safetensors

WEIGHTS = "model.safetensors"
TOKENIZER_MODULE = "tokenization_paraflax"  # `auto_map`'s class, for trust_remote_code=True
AUTO_MAP = {"AutoTokenizer": [None, f"{TOKENIZER_MODULE}.ParaflaxTokenizer"]}
_TOKENIZER_CLASS = '''"""This directory's tokenizer exactly as tokenizer.json defines it (written by
paraflax: `auto_map` in tokenizer_config.json names it, so that `AutoTokenizer` never rebuilds
it with a model family's own pre-tokenizer)."""

from transformers import PreTrainedTokenizerFast


class ParaflaxTokenizer(PreTrainedTokenizerFast):
  """`PreTrainedTokenizerFast` over tokenizer.json, unchanged."""
'''


def _write_json(file: Path, obj) -> None:
  file.write_text(json.dumps(obj, indent=2) + "\n")


def _bos_id(tokenizer: Tokenizer) -> int | None:
  """The id the tokenizer's post-processor puts before every text (Llama's `<s>`), if any."""
  plain = tokenizer.backend.encode("a", add_special_tokens=False).ids
  full = tokenizer.backend.encode("a", add_special_tokens=True).ids
  return full[0] if len(full) == len(plain) + 1 and full[1:] == plain else None


def special_ids(tokenizer: Tokenizer, eos_ids: Sequence[int] | None = None) -> dict:
  """{"bos_token_id", "eos_token_id", "pad_token_id"} as Hugging Face configs write them:
  EOS an int, or a list when `eos_ids` names several (default: every one of the tokenizer's
  `eos_ids`); BOS the tokenizer's, else the one its post-processor adds; roles the tokenizer
  lacks are left out."""
  eos = list(eos_ids) if eos_ids else list(tokenizer.eos_ids)
  bos = tokenizer.bos_id if tokenizer.bos_id is not None else _bos_id(tokenizer)
  ids = {"bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else eos,
         "pad_token_id": tokenizer.pad_id}
  return {k: v for k, v in ids.items() if v not in (None, [])}


def _tokenizer_config(tokenizer: Tokenizer, ids: dict, max_len: int) -> dict:
  """`tokenizer_config.json`: the special-token strings, `<mask>`/`<sep>` as extra specials
  (and as mask_token / sep_token, which `load_hf_tokenizer` reads back), the chat template,
  and `split_special_tokens` so that text encodes as paraflax encodes it."""
  name = tokenizer.backend.id_to_token
  eos = ids.get("eos_token_id")
  roles = {"bos_token": ids.get("bos_token_id"),
           "eos_token": eos[0] if isinstance(eos, list) else eos,
           "pad_token": ids.get("pad_token_id")}
  tokens = {k: name(v) for k, v in roles.items() if v is not None}
  extra = [name(i) for i in (tokenizer.mask_id, tokenizer.sep_id) if i is not None]
  tokens |= {k: name(i) for k, i in (("mask_token", tokenizer.mask_id),
                                     ("sep_token", tokenizer.sep_id)) if i is not None}
  template = {} if tokenizer.chat_template is None else {"chat_template": tokenizer.chat_template}
  return {"tokenizer_class": "PreTrainedTokenizerFast", "auto_map": AUTO_MAP, **tokens, **template,
          "additional_special_tokens": extra,
          "split_special_tokens": tokenizer.backend.encode_special_tokens,
          "clean_up_tokenization_spaces": False, "model_max_length": max_len}


def write_tokenizer_files(out: Path, tokenizer: Tokenizer, max_len: int,
                          eos_ids: Sequence[int] | None = None) -> None:
  """tokenizer.json, tokenizer_config.json (with its `auto_map`), tokenization_paraflax.py,
  special_tokens_map.json and generation_config.json (the token roles of `special_ids`) into
  the directory `out`: what makes `AutoTokenizer` encode as `tokenizer` does."""
  ids = special_ids(tokenizer, eos_ids)
  tokenizer.save(out / "tokenizer.json")
  config = _tokenizer_config(tokenizer, ids, max_len)
  _write_json(out / "tokenizer_config.json", config)  # replacing what `save` may write
  (out / f"{TOKENIZER_MODULE}.py").write_text(_TOKENIZER_CLASS)
  _write_json(out / "special_tokens_map.json",
              {k: v for k, v in config.items()
               if k.endswith("_token") or k == "additional_special_tokens"})
  _write_json(out / "generation_config.json", {**ids, "do_sample": False})


def write_auto_map(out: str | os.PathLike) -> None:
  """Give the Hugging Face directory `out` the `auto_map` every export carries: into its
  tokenizer_config.json (made if absent; its other settings kept) and the class it names
  beside it, so that transformers' `AutoTokenizer` reads tokenizer.json as it is."""
  out = Path(out)
  file = out / "tokenizer_config.json"
  config = json.loads(file.read_text()) if file.is_file() else {}
  _write_json(file, {**config, "tokenizer_class": "PreTrainedTokenizerFast", "auto_map": AUTO_MAP})
  (out / f"{TOKENIZER_MODULE}.py").write_text(_TOKENIZER_CLASS)


def export_hf(model, out_dir: str | os.PathLike, tokenizer: Tokenizer | None = None, *,
              eos_ids: Sequence[int] | None = None, overwrite: bool = False,
              source: str | os.PathLike | None = None) -> Path:
  """Write `config.json` and `model.safetensors` into `out_dir` (and, given `tokenizer`, the
  tokenizer files, its chat template and `generation_config.json`, with every id in `eos_ids`
  as EOS, by default every one of `tokenizer.eos_ids`); return it.

  `out_dir` must be absent or empty, or `overwrite` given; it is never a paraflax workdir, a
  store or `source` (the directory the model was loaded from), nor contains or lies inside one
  (`destination.check_output`). The files appear together (`destination.replacing`)."""
  cfg = model.cfg
  ids = special_ids(tokenizer, eos_ids) if tokenizer is not None else {}
  hf_cfg = hf_config_from_model(cfg, bos_id=ids.get("bos_token_id"),
                                eos_id=ids.get("eos_token_id"),
                                pad_id=ids.get("pad_token_id"))  # raises before any write
  out = destination.check_output(out_dir, overwrite=overwrite, source=source)
  with destination.replacing(out) as tmp:
    _write(model, tmp, hf_cfg, tokenizer, eos_ids)
  return out


def _write(model, out: Path, hf_cfg: dict, tokenizer: Tokenizer | None, eos_ids) -> None:
  _, params = nnx.split(model, nnx.Param)
  tensors = []
  for path, var in nnx.to_flat_state(params):
    e = layout.entry(path, var.shape)
    tensors.append((e.hf_name, e.hf_shape, np.dtype(var.dtype),
                    lambda var=var, e=e: layout.to_hf(np.asarray(var.get_value()), e)))
  tensors.sort(key=lambda t: t[0])
  write_safetensors(out / WEIGHTS, tensors)
  _write_json(out / "config.json", hf_cfg)
  if tokenizer is not None:
    write_tokenizer_files(out, tokenizer, model.cfg.max_seq_len, eos_ids)
