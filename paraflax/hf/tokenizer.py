"""The tokenizer of a Hugging Face checkpoint, with its EOS/PAD ids resolved from its configs."""

from __future__ import annotations

import os
from pathlib import Path

from paraflax.data.tokenizer import Tokenizer
from paraflax.json_io import read_json


def _json(file: Path) -> dict:
  return read_json(file) if file.is_file() else {}  # an invalid file is an error naming it


def _token(value, backend) -> str | None:
  """A token string from an id, a list of ids (the first), a string or an AddedToken dict."""
  if isinstance(value, list):
    value = value[0] if value else None
  if isinstance(value, dict):
    value = value.get("content")
  if isinstance(value, int):
    return backend.id_to_token(value)
  return value if isinstance(value, str) else None


def load_hf_tokenizer(path: str | os.PathLike, *,
                      encode_special_tokens: bool = False) -> Tokenizer:
  """`Tokenizer` over `<path>/tokenizer.json`, with `eos_id` / `pad_id` from the checkpoint.

  EOS comes from generation_config.json, then config.json, then tokenizer_config.json (a
  list of EOS ids gives its first). `encode_special_tokens=False` (the Hugging Face default)
  parses special-token strings such as "<|im_end|>" in text, as chat templates need.
  """
  path = Path(path).expanduser()
  file = path / "tokenizer.json" if path.is_dir() else path
  if not file.is_file():
    raise FileNotFoundError(f"{str(file)!r} not found: the checkpoint has no tokenizer.json "
                            "(only fast-tokenizer JSON files are supported)")
  base = Tokenizer.from_file(file)
  root = file.parent
  gen, cfg, tok = (_json(root / n) for n in ("generation_config.json", "config.json",
                                              "tokenizer_config.json"))
  roles = {}
  for role in ("eos", "pad"):
    for source in (gen.get(f"{role}_token_id"), cfg.get(f"{role}_token_id"),
                   tok.get(f"{role}_token")):
      token = _token(source, base.backend)
      if token is not None and base.backend.token_to_id(token) is not None:
        roles[role] = token
        break
  return Tokenizer(base.backend, special_tokens=roles,
                   encode_special_tokens=encode_special_tokens)


def eos_ids(path: str | os.PathLike, tokenizer: Tokenizer) -> list[int]:
  """Every EOS id of the checkpoint (or workdir) at `path`: the list in generation_config.json,
  else config.json (Llama-3.1-Instruct names three), within `tokenizer`'s vocabulary; else
  `tokenizer.eos_id` alone."""
  path = Path(path).expanduser()
  for name in ("generation_config.json", "config.json"):
    value = _json(path / name).get("eos_token_id")
    found = [i for i in (value if isinstance(value, list) else [value])
             if isinstance(i, int) and 0 <= i < tokenizer.vocab_size]
    if found:
      return found
  return [] if tokenizer.eos_id is None else [tokenizer.eos_id]


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
  """Token ids of `text` as Hugging Face encodes a prompt by default (`add_special_tokens`):
  with the tokenizer's own BOS where it adds one (Llama), nothing extra for Qwen."""
  return tokenizer.backend.encode(text, add_special_tokens=True).ids
