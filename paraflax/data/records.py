"""JSONL records (`jsonl.py`) as token ids and loss masks (training) or prompt ids (collection).

Each record is a prompt part and a reply part, encoded separately (a clean boundary):

    text     "" | text                                       every token a target
    pair     prompt | response                              plain, or with `chat` the template's
                                                             user turn | assistant reply
    chat     template(messages[:-1], add_generation_prompt)  | the rest of template(messages)

    ids       = [BOS] + encode(prompt) + encode(reply) + [EOS]          int32 [n]
    loss_mask = 0 ... 0                 1 ... 1          1              int8  [n]

BOS only where the tokenizer has `bos_id` and no template wrote the text (a template writes its
own); EOS (`tok.eos_id`) unless the reply already ends with it (a template's reply drops the
whitespace it writes after the end of turn: "...<|im_end|>" + EOS, or just "...<|im_end|>"
when that is the EOS). Template text is encoded as the tokenizer encodes text: a Hugging Face
tokenizer parses the special-token strings a template writes. `loss_on="response"` (the SFT
convention) makes only the reply and EOS targets: with a template the reply is the last
assistant message and its end-of-turn token (so the model learns to stop); earlier assistant
turns are prompt. `loss_on="all"` makes every token a target;
text records always are. `loss_mask[i] = 1`: token i is a target (predicted from token i-1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from paraflax.data.jsonl import ChatRecord, PairRecord, Record, TextRecord

LOSS_ON = ("response", "all")
CHAT = ("auto", "yes", "no")
_CHUNK = 64  # records per encode_batch call


def chat_mode(value) -> str:
  """"auto", "yes" or "no" from a config value (bools and their strings included)."""
  mode = {True: "yes", False: "no", "true": "yes", "false": "no"}.get(
      value.lower() if isinstance(value, str) else value, value)
  if mode not in CHAT:
    raise ValueError(f"chat must be one of {list(CHAT)} (or True/False), got {value!r}")
  return mode


def split_key(record: Record) -> str:
  """The text a record's train/validation split is hashed from (equal records: one side)."""
  if isinstance(record, ChatRecord):
    return json.dumps(record.messages, ensure_ascii=False)
  return record.text


@dataclasses.dataclass(frozen=True, eq=False)
class RecordEncoder:
  """How records become ids: a `Tokenizer`, its chat template (`chat.ChatTemplate`, or
  None), `loss_on` ("response" | "all") and `chat` ("auto": prompt/response pairs go through
  the template when there is one; "yes": always, refused without one; "no": never)."""

  tokenizer: Any
  template: Any = None
  loss_on: str = "response"
  chat: str = "auto"

  def __post_init__(self):
    if self.loss_on not in LOSS_ON:
      raise ValueError(f"loss_on must be one of {list(LOSS_ON)}, got {self.loss_on!r}")
    object.__setattr__(self, "chat", chat_mode(self.chat))
    if self.chat == "yes" and self.template is None:
      raise ValueError("chat='yes' needs a tokenizer with a chat template (data.tokenizer: a "
                       "model directory whose tokenizer_config.json has `chat_template`)")
    if self.tokenizer.eos_id is None:
      raise ValueError("the tokenizer has no EOS token; records need one to end")

  @property
  def pairs_as_chat(self) -> bool:
    return self.template is not None and self.chat != "no"

  def fingerprint(self) -> str:
    """What the encoding depends on (a cache key)."""
    h = hashlib.sha1(b"paraflax-records-v1\0")
    for part in (self.tokenizer.fingerprint(), self.loss_on, str(self.pairs_as_chat),
                 json.dumps(None if self.template is None else dataclasses.astuple(self.template)),
                 str(getattr(self.tokenizer, "bos_id", None))):
      h.update(part.encode("utf-8") + b"\0")
    return h.hexdigest()

  def parts(self, record: Record) -> tuple[str, str, bool]:
    """(prompt text, reply text, whether a template wrote them)."""
    if isinstance(record, TextRecord):
      return "", record.text, False
    if isinstance(record, PairRecord) and not self.pairs_as_chat:
      return record.prompt, record.response, False
    if self.template is None:
      raise ValueError("chat records ('messages') need a chat template: set data.tokenizer to "
                       "a model directory that has one (tokenizer_config.json `chat_template` "
                       "or chat_template.jinja)")
    messages = (record.as_dicts() if isinstance(record, ChatRecord) else
                [{"role": "user", "content": record.prompt},
                 {"role": "assistant", "content": record.response}])
    prompt, reply = self.template.split(messages)
    return prompt, reply.rstrip(), True  # the newline after the end of turn: EOS follows

  def _bos(self, templated: bool) -> list[int]:
    bos = getattr(self.tokenizer, "bos_id", None)
    return [] if templated or bos is None else [bos]

  def encode_many(self, records: Sequence[Record]) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids int32 [n], loss_mask int8 [n])] of `records` (see the module docstring)."""
    parts = [self.parts(r) for r in records]
    prompts = self.tokenizer.encode_batch([p for p, _, _ in parts])
    replies = self.tokenizer.encode_batch([r for _, r, _ in parts])
    eos, out = self.tokenizer.eos_id, []
    for record, (_, _, templated), p, r in zip(records, parts, prompts, replies):
      head = self._bos(templated) + list(p)
      tail = list(r) + ([] if r and r[-1] == eos else [eos])
      every = self.loss_on == "all" or isinstance(record, TextRecord)
      mask = [int(every)] * len(head) + [1] * len(tail)
      out.append((np.asarray(head + tail, np.int32), np.asarray(mask, np.int8)))
    return out

  def prompt_ids(self, record: Record) -> list[int]:
    """The ids a model continues for `record` (collection): a pair's prompt (as a user turn
    under the template when `chat` says so), a chat's messages before the last reply with the
    assistant's turn opened, or a text record's whole document (callers cut a prefix)."""
    if isinstance(record, TextRecord):
      return self._bos(False) + self.tokenizer.encode(record.text)
    if isinstance(record, PairRecord) and not self.pairs_as_chat:
      return self._bos(False) + self.tokenizer.encode(record.prompt)
    if self.template is None:
      raise ValueError("chat records ('messages') need a model with a chat template "
                       "(tokenizer_config.json `chat_template` or chat_template.jinja)")
    messages = (record.as_dicts(-1) if isinstance(record, ChatRecord) else
                [{"role": "user", "content": record.prompt}])
    return self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True))


def _key(records: Sequence[Record], encoder: RecordEncoder) -> str:
  h = hashlib.sha1(encoder.fingerprint().encode())
  for r in records:
    data = (type(r).__name__ + json.dumps(dataclasses.astuple(r), ensure_ascii=False)).encode()
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
  return h.hexdigest()


def encode_records(records: Sequence[Record], encoder: RecordEncoder, *, progress: bool = True,
                   desc: str = "tokenizing") -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [N], loss_mask int8 [N]): every record's ids and mask, concatenated."""
  if not records:
    raise ValueError("no records to tokenize")
  ids, masks = [], []
  with tqdm(total=len(records), desc=desc, unit="record", disable=not progress) as bar:
    for start in range(0, len(records), _CHUNK):
      chunk = records[start:start + _CHUNK]
      for i, m in encoder.encode_many(chunk):
        ids.append(i)
        masks.append(m)
      bar.update(len(chunk))
  return np.concatenate(ids), np.concatenate(masks)


def record_streams(records: Sequence[Record], encoder: RecordEncoder,
                   cache_dir: str | os.PathLike | None = None, *, progress: bool = True,
                   desc: str = "tokenizing") -> tuple[np.ndarray, np.ndarray]:
  """`encode_records`, cached as `<cache_dir>/records-<key>.{tokens,mask}.npy` when cache_dir is
  set (a cached pair is memory-mapped read-only)."""
  if cache_dir is None:
    return encode_records(records, encoder, progress=progress, desc=desc)
  base = Path(cache_dir).expanduser() / f"records-{_key(records, encoder)}"
  paths = [base.with_name(base.name + f".{k}.npy") for k in ("tokens", "mask")]
  if not all(p.is_file() for p in paths):
    arrays = encode_records(records, encoder, progress=progress, desc=desc)
    base.parent.mkdir(parents=True, exist_ok=True)
    for p, a in zip(paths, arrays):
      tmp = p.with_name(p.stem + f".tmp{os.getpid()}.npy")
      np.save(tmp, a)
      os.replace(tmp, p)  # atomic: a killed run never leaves a truncated cache
  tokens, mask = (np.load(p, mmap_mode="r") for p in paths)
  return tokens, mask
