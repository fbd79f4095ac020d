"""A tokenizer's roles (every EOS id, PAD, BOS, mask, sep, chat template) in the Hugging Face
files beside its `tokenizer.json`, read and written the way Hugging Face checkpoints hold them:

    generation_config.json  eos_token_id (an int or a list), bos_token_id, pad_token_id
    config.json             the same keys (read only: a checkpoint's model config)
    tokenizer_config.json   eos/pad/bos/mask/sep_token, chat_template, split_special_tokens
    chat_template.jinja     the chat template (read by `paraflax.data.chat.chat_template`)

Each role comes from the first file that names a token of the vocabulary, in that order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import tokenizers
from etils import epath

from paraflax.data.chat import chat_template
from paraflax.json_io import read_json_object, write_json

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"


@dataclasses.dataclass(frozen=True)
class Roles:
  """What the files beside a tokenizer.json say: role -> token string ("pad", "bos", "mask",
  "sep"; absent: not named), every EOS id in order, the chat template, and HF's
  `split_special_tokens` (paraflax's `encode_special_tokens`; None: not said)."""
  tokens: Mapping[str, str]
  eos_ids: tuple[int, ...] = ()
  chat_template: str | None = None
  split_special_tokens: bool | None = None


def _json(file: epath.Path) -> dict:
  return read_json_object(file) if file.is_file() else {}  # an invalid one: an error naming it


def _ids(value, backend: tokenizers.Tokenizer) -> list[int]:
  """The vocabulary ids `value` names: an id, a list of ids, a token string or an AddedToken
  dict ({"content": ...}); ids outside the vocabulary and unknown strings are dropped."""
  values = value if isinstance(value, list) else [value]
  size = backend.get_vocab_size(with_added_tokens=True)
  out = []
  for v in values:
    if isinstance(v, dict):
      v = v.get("content")
    if isinstance(v, str):
      v = backend.token_to_id(v)
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < size:
      out.append(v)
  return list(dict.fromkeys(out))


def _first(sources, backend: tokenizers.Tokenizer) -> list[int]:
  """The ids of the first of `sources` that names any (they are in order of precedence)."""
  return next((ids for ids in (_ids(v, backend) for v in sources) if ids), [])


def read_roles(root: str | epath.PathLike, backend: tokenizers.Tokenizer) -> Roles:
  """The roles the files in directory `root` give the vocabulary of `backend`."""
  root = epath.Path(root)
  gen, cfg, tok = (_json(root / n) for n in (GENERATION_CONFIG, "config.json", TOKENIZER_CONFIG))
  configs = lambda role: (gen.get(f"{role}_token_id"), cfg.get(f"{role}_token_id"),
                          tok.get(f"{role}_token"))
  tokens = {}
  for role in ("pad", "bos", "mask", "sep"):  # HF model configs name no mask / sep ids
    ids = _first(configs(role) if role in ("pad", "bos") else [tok.get(f"{role}_token")],
                 backend)
    if ids:
      tokens[role] = backend.id_to_token(ids[0])
  split = tok.get("split_special_tokens")
  return Roles(tokens=tokens, eos_ids=tuple(_first(configs("eos"), backend)),
               chat_template=chat_template(root),
               split_special_tokens=split if isinstance(split, bool) else None)


def _update(file: epath.Path, values: Mapping) -> None:
  """Set the keys of `values` in the JSON object in `file` (None: remove), keeping the rest."""
  obj = _json(file)
  obj.update({k: v for k, v in values.items() if v is not None})
  for k in [k for k, v in values.items() if v is None]:
    obj.pop(k, None)
  write_json(file, obj)


def write_roles(root: str | epath.PathLike, tokenizer) -> None:
  """Write `tokenizer`'s roles (a `Tokenizer`) into the files in directory `root`, keeping
  their other keys; an existing chat_template.jinja is rewritten (or removed without a
  template) so that it never shadows tokenizer_config.json's."""
  root = epath.Path(root)
  name = lambda i: None if i is None else tokenizer.backend.id_to_token(i)
  eos = list(tokenizer.eos_ids)
  _update(root / GENERATION_CONFIG, {
      "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
      "bos_token_id": tokenizer.bos_id, "pad_token_id": tokenizer.pad_id})
  _update(root / TOKENIZER_CONFIG, {
      "eos_token": name(tokenizer.eos_id), "pad_token": name(tokenizer.pad_id),
      "bos_token": name(tokenizer.bos_id), "mask_token": name(tokenizer.mask_id),
      "sep_token": name(tokenizer.sep_id), "chat_template": tokenizer.chat_template,
      "split_special_tokens": tokenizer.backend.encode_special_tokens})
  jinja = root / CHAT_TEMPLATE
  if jinja.exists() and tokenizer.chat_template is None:
    jinja.unlink()
  elif jinja.exists():
    jinja.write_text(tokenizer.chat_template, encoding="utf-8")
