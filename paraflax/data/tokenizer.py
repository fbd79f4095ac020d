"""Byte-level BPE tokenizer (HF `tokenizers`), trained offline, with exact round trip.

Tokenizers trained here reserve four special tokens at fixed ids:

    <pad> = 0    <eos> = 1    <mask> = 2    <sep> = 3

Byte-level pre-tokenization (no prefix space, no normalizer, no trimming) and the
byte-level decoder make `decode(encode(s)) == s` for every string `s`. Special-token
strings that occur inside text are encoded as ordinary text by default
(`encode_special_tokens=True`), so `encode` never emits a special id from text and
"<eos>" written in a source file stays literal.

Any tokenizer (a Hugging Face checkpoint's too) carries its roles: every EOS id, PAD, BOS,
mask, sep and the chat template, kept in Hugging Face's own files beside tokenizer.json
(`tokenizer_roles`): `load` reads them, `save` writes them unless they are the defaults above.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import tokenizers
from etils import epath
from tokenizers import decoders, models, pre_tokenizers, trainers

from paraflax.data.tokenizer_roles import read_roles, write_roles
from paraflax.json_io import write_atomic

PAD, EOS, MASK, SEP = "<pad>", "<eos>", "<mask>", "<sep>"
SPECIAL_TOKENS = (PAD, EOS, MASK, SEP)  # ids 0, 1, 2, 3 in trained tokenizers
_ROLES = {"pad": PAD, "eos": EOS, "mask": MASK, "sep": SEP, "bos": None}  # role -> default
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte + the specials


def _role_ids(hf: tokenizers.Tokenizer, special_tokens: Mapping[str, str] | None) -> dict:
  """role -> id (None: the vocabulary lacks the token) with `special_tokens` over the defaults."""
  roles = dict(_ROLES)
  for role, token in (special_tokens or {}).items():
    if role not in _ROLES:
      raise ValueError(f"unknown special-token role {role!r}; expected {sorted(_ROLES)}")
    roles[role] = token
  return {role: None if token is None else hf.token_to_id(token) for role, token in roles.items()}


def _check_eos_ids(eos_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
  ids = list(eos_ids)
  bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)
         or not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"eos_ids {bad[:5]} are not ids of the vocabulary [0, {vocab_size})")
  return tuple(dict.fromkeys(int(i) for i in ids))


class Tokenizer:
  """Thin wrapper over a `tokenizers.Tokenizer` exposing the ids the library needs.

  `pad_id`, `eos_id`, `bos_id`, `mask_id`, `sep_id` are ints, or None when the wrapped
  vocabulary has no such token (common for Hugging Face checkpoints' tokenizers). `eos_ids`
  holds every EOS id (Llama-3.1-Instruct has three; `eos_id` is the first), `chat_template`
  the checkpoint's Jinja chat template or None.
  """

  def __init__(
    self,
    hf: tokenizers.Tokenizer,
    *,
    special_tokens: Mapping[str, str] | None = None,
    encode_special_tokens: bool = True,
    eos_ids: Sequence[int] | None = None,
    chat_template: str | None = None,
  ):
    """`special_tokens` maps roles (pad, eos, bos, mask, sep) to token strings; `eos_ids`,
    when given, are every EOS id (the "eos" role then is their first)."""
    ids = _role_ids(hf, special_tokens)
    self._hf = hf
    # Not stored in tokenizer.json, so it is set on every load.
    self._hf.encode_special_tokens = encode_special_tokens
    self.pad_id: int | None = ids["pad"]
    self.bos_id: int | None = ids["bos"]
    self.mask_id: int | None = ids["mask"]
    self.sep_id: int | None = ids["sep"]
    if eos_ids is None:
      eos_ids = () if ids["eos"] is None else (ids["eos"],)
    self.eos_ids: tuple[int, ...] = _check_eos_ids(eos_ids, self.vocab_size)
    self.eos_id: int | None = self.eos_ids[0] if self.eos_ids else None
    self.chat_template: str | None = chat_template

  def _roles(self) -> tuple:
    return (self.pad_id, self.eos_ids, self.bos_id, self.mask_id, self.sep_id,
            self.chat_template)

  def has_default_roles(self) -> bool:
    """Whether tokenizer.json alone gives these roles (`<pad>`, `<eos>`, `<mask>`, `<sep>` by
    name, no BOS, no chat template): then `save` writes tokenizer.json only."""
    ids = _role_ids(self._hf, None)
    default = (ids["pad"], () if ids["eos"] is None else (ids["eos"],), ids["bos"],
               ids["mask"], ids["sep"], None)
    return self._roles() == default

  def with_special_tokens(self, roles: Mapping[str, str]) -> Tokenizer:
    """A copy whose `roles` ({"mask": "<mask>", "sep": "<|fim_pad|>"}) are these tokens: one the
    vocabulary has keeps its id; a missing one is added as a special token at the next id.
    The other roles (every EOS id, BOS, the chat template) are kept. `self` is unchanged."""
    hf = tokenizers.Tokenizer.from_str(self._hf.to_str())
    missing = [t for t in dict.fromkeys(roles.values()) if hf.token_to_id(t) is None]
    if missing:
      hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                             for t in missing])
    named = {role: self._hf.id_to_token(i) for role, i in
             (("pad", self.pad_id), ("mask", self.mask_id), ("sep", self.sep_id),
              ("bos", self.bos_id)) if i is not None}
    return Tokenizer(hf, special_tokens={**named, **roles},
                     encode_special_tokens=self._hf.encode_special_tokens,
                     eos_ids=None if "eos" in roles else self.eos_ids,
                     chat_template=self.chat_template)

  def without_method_tokens(self) -> Tokenizer:
    """This tokenizer without its own method tokens: the `mask` and `sep` roles' tokens where
    they were added after every other id (`with_special_tokens`), e.g. a TiDAR's tokenizer ->
    its base model's. The other roles are kept; `self` is unchanged."""
    own = {i for i in (self.mask_id, self.sep_id) if i is not None}
    size, model_ids = self.vocab_size, self._hf.get_vocab_size(with_added_tokens=False)
    while size - 1 in own and size - 1 >= model_ids:
      size -= 1
    if size == self.vocab_size:
      return self
    data = json.loads(self._hf.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < size]
    named = {role: self._hf.id_to_token(i) for role, i in (("pad", self.pad_id),
                                                           ("bos", self.bos_id)) if i is not None}
    return Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(data)), special_tokens=named,
                     encode_special_tokens=self._hf.encode_special_tokens,
                     eos_ids=self.eos_ids, chat_template=self.chat_template)

  @property
  def vocab_size(self) -> int:
    """Number of ids, special tokens included (max id + 1)."""
    return self._hf.get_vocab_size(with_added_tokens=True)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped `tokenizers.Tokenizer`."""
    return self._hf

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (no BOS/EOS added)."""
    if not isinstance(text, str):
      raise ValueError(f"encode expects a str, got {type(text).__name__}")
    return self._hf.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`encode` over many texts (parallel in Rust)."""
    return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """Text of `ids`; special tokens appear as their strings unless skipped."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
    return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

  def fingerprint(self) -> str:
    """sha1 of the serialized tokenizer (vocabulary, merges, added and special tokens,
    normalizer, pre-tokenizer, post-processor, decoder, truncation and padding): equal
    fingerprints encode identically. Ours and Hugging Face ones (`load_hf_tokenizer`) alike."""
    return hashlib.sha1(self._hf.to_str().encode("utf-8")).hexdigest()

  def save(self, path: str | os.PathLike) -> epath.Path:
    """Write `tokenizer.json` (to `path`, or into it if it is a directory; local or `gs://`),
    and, unless `has_default_roles()`, the roles beside it in Hugging Face's files
    (generation_config.json, tokenizer_config.json: `tokenizer_roles`), so that `load` and
    transformers read this tokenizer back."""
    path = epath.Path(path)
    if path.is_dir():
      path = path / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, self._hf.to_str(pretty=True))  # readers never see a half-written file
    if not self.has_default_roles():
      write_roles(path.parent, self)
    return path

  @classmethod
  def from_file(
    cls,
    path: str | os.PathLike,
    *,
    special_tokens: Mapping[str, str] | None = None,
    encode_special_tokens: bool | None = None,
  ) -> Tokenizer:
    """Wrap any `tokenizers` JSON file (ours or a Hugging Face checkpoint's), with the roles
    the Hugging Face files beside it name (`tokenizer_roles.read_roles`: every EOS id, PAD,
    BOS, mask, sep, the chat template); a role they do not name keeps its default token.

    `special_tokens` maps roles to token strings, e.g. `{"eos": "<|endoftext|>"}`, over
    the files. Pass `encode_special_tokens=False` where text must parse special tokens
    (chat templates); the exact round trip then excludes those strings. None: the files'
    `split_special_tokens`, else True.
    """
    path = epath.Path(path)
    if path.is_dir():
      path = path / "tokenizer.json"
    if not path.is_file():
      raise FileNotFoundError(f"tokenizer file {str(path)!r} not found")
    try:
      hf = tokenizers.Tokenizer.from_str(path.read_text(encoding="utf-8"))
    except Exception as e:  # the Rust side raises a bare Exception
      raise ValueError(f"{path}: not a valid tokenizers JSON file ({e})") from None
    found = read_roles(path.parent, hf)
    special_tokens = dict(special_tokens or {})
    eos_ids = found.eos_ids if found.eos_ids and "eos" not in special_tokens else None
    if encode_special_tokens is None:  # unsaid: Hugging Face's default in its files, ours alone
      split = found.split_special_tokens
      hf_files = (path.parent / "tokenizer_config.json").is_file()
      encode_special_tokens = (not hf_files) if split is None else split
    return cls(hf, special_tokens={**found.tokens, **special_tokens},
               encode_special_tokens=encode_special_tokens, eos_ids=eos_ids,
               chat_template=found.chat_template)

  load = from_file

  def __repr__(self) -> str:
    return (
      f"Tokenizer(vocab_size={self.vocab_size}, pad_id={self.pad_id}, "
      f"eos_ids={self.eos_ids}, bos_id={self.bos_id}, mask_id={self.mask_id}, "
      f"sep_id={self.sep_id}, chat_template={self.chat_template is not None})"
    )


def load_tokenizer(path: str | os.PathLike, *, mask_token: str | None = None,
                   sep_token: str | None = None) -> Tokenizer:
  """The tokenizer of the model directory `path` (a Hugging Face checkpoint, a training workdir,
  a `paraflax convert` output) with the roles its files name, and the method tokens
  `mask_token` / `sep_token` (strings) in the `mask` / `sep` roles, added when the vocabulary
  lacks them (`Tokenizer.with_special_tokens`)."""
  path = epath.Path(path)
  if not (path / "tokenizer.json").is_file():
    raise ValueError(f"{str(path)!r} has no tokenizer: expected a Hugging Face directory "
                     "(config.json + *.safetensors + tokenizer.json) or a paraflax workdir")
  tok = Tokenizer.load(path)
  roles = {k: v for k, v in (("mask", mask_token), ("sep", sep_token)) if v is not None}
  return tok.with_special_tokens(roles) if roles else tok


def train_tokenizer(
  texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, progress: bool = False
) -> Tokenizer:
  """Train a byte-level BPE with the four specials at ids 0..3 (deterministic)."""
  if vocab_size < MIN_VOCAB_SIZE:
    raise ValueError(
      f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + 4 specials), got {vocab_size}"
    )
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=min_frequency,
    special_tokens=list(SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no <unk>
    show_progress=progress,
  )
  hf.train_from_iterator(texts, trainer)
  tok = Tokenizer(hf)
  ids = (tok.pad_id, tok.eos_id, tok.mask_id, tok.sep_id)
  if ids != (0, 1, 2, 3):
    raise RuntimeError(f"special tokens got ids {ids}, expected (0, 1, 2, 3)")
  return tok


def load_or_train(
  cache_dir: str | os.PathLike,
  texts_fn: Callable[[], Iterable[str]],
  vocab_size: int,
  *,
  name: str = "corpus",
  progress: bool = True,
) -> Tokenizer:
  """Load `<cache_dir>/tokenizer-<name>-v<vocab_size>.json`, or train on `texts_fn()` and save.

  `name` identifies the training corpus: change it when the corpus changes.
  """
  if not re.fullmatch(r"[A-Za-z0-9._+-]+", name):
    raise ValueError(f"name must be filename-safe ([A-Za-z0-9._+-]+), got {name!r}")
  path = Path(cache_dir).expanduser() / f"tokenizer-{name}-v{vocab_size}.json"
  if path.is_file():
    return Tokenizer.load(path)
  tok = train_tokenizer(texts_fn(), vocab_size, progress=progress)
  tok.save(path)
  return tok
