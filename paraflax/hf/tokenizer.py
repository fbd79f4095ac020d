"""The tokenizer of a Hugging Face checkpoint, with its roles (every EOS id, PAD, BOS, chat
template) resolved from its configs."""

from __future__ import annotations

import os
from pathlib import Path

from paraflax.data.tokenizer import Tokenizer
from paraflax.hf import auto_tokenizer
from paraflax.json_io import read_json_object


def load_hf_tokenizer(path: str | os.PathLike, *,
                      encode_special_tokens: bool | None = None) -> Tokenizer:
  """`Tokenizer` over `<path>/tokenizer.json`, with its roles from the checkpoint's configs.

  Every EOS id comes from generation_config.json, then config.json, then tokenizer_config.json
  (Llama-3.1-Instruct lists three: `eos_ids`; `eos_id` is the first); PAD and BOS likewise,
  the chat template from chat_template.jinja or tokenizer_config.json
  (`paraflax.data.tokenizer_roles`). `encode_special_tokens`: as tokenizer_config.json's
  `split_special_tokens` says, else False (the Hugging Face default: special-token strings
  such as "<|im_end|>" in text are parsed, as chat templates need).

  When transformers is installed and its `AutoTokenizer` encodes the directory otherwise, a
  `TokenizerWarning` says so (`auto_tokenizer.check`): paraflax uses tokenizer.json.
  """
  path = Path(path).expanduser()
  file = path / "tokenizer.json" if path.is_dir() else path
  if not file.is_file():
    raise FileNotFoundError(f"{str(file)!r} not found: the checkpoint has no tokenizer.json "
                            "(only fast-tokenizer JSON files are supported)")
  if encode_special_tokens is None:  # transformers' rule: the file's setting, else False
    config = file.parent / "tokenizer_config.json"
    split = (read_json_object(config) if config.is_file() else {}).get("split_special_tokens")
    encode_special_tokens = split if isinstance(split, bool) else False
  tok = Tokenizer.from_file(file, encode_special_tokens=encode_special_tokens)
  if path.is_dir():
    auto_tokenizer.check(path, tok)
  return tok


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
  """Token ids of `text` as Hugging Face encodes a prompt by default (`add_special_tokens`):
  with the tokenizer's own BOS where it adds one (Llama), nothing extra for Qwen."""
  return tokenizer.backend.encode(text, add_special_tokens=True).ids
