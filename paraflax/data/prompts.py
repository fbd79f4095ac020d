"""Prompts as the commands take them: `--prompt` texts and JSONL prompt records
(`read_prompts`), rendered as text (`prompt_text`) and encoded (`prompt_ids`), a chat under the
model's chat template."""

from __future__ import annotations

import os

from paraflax.data.chat import chat_prompt
from paraflax.data.jsonl import json_lines


def read_prompts(prompt=(), prompts_file=None) -> list:
  """The `--prompt` texts, then the records of the JSONL `prompts_file`: a `prompt` text, or
  chat `messages` ([{"role", "content"}, ...])."""
  prompts = list(prompt or ())
  if prompts_file and not os.path.isfile(prompts_file):
    raise FileNotFoundError(f"--prompts-file {prompts_file!r} not found")
  for where, record in json_lines(prompts_file) if prompts_file else ():
    value = record.get("prompt", record.get("messages")) if isinstance(record, dict) else None
    if not isinstance(value, (str, list)):
      raise ValueError(f"{where}: expected a JSON object with \"prompt\" (a text) or "
                       "\"messages\" (a chat)")
    prompts.append(value)
  if prompts_file and len(prompts) == len(prompt or ()):
    raise ValueError(f"--prompts-file {prompts_file!r} holds no records: one JSON object per "
                     "line, {\"prompt\": TEXT} or {\"messages\": [...]}")
  if not prompts:
    raise ValueError("no prompt: give --prompt TEXT or --prompts-file FILE.jsonl")
  return prompts


def prompt_text(prompt, chat: bool, path) -> str:
  """The text a prompt is: a text as given, or (as a user turn with `chat`) chat messages
  under the chat template of the model directory `path`, the assistant's turn opened."""
  if not chat and isinstance(prompt, str):
    return prompt
  return chat_prompt(path, [{"role": "user", "content": prompt}] if chat else prompt)


def prompt_ids(prompt, chat: bool, tok, encode, path) -> list[int]:
  """Token ids of a text (as a user turn with `chat`) or of chat messages (the template's)."""
  if chat or not isinstance(prompt, str):  # the template writes BOS
    ids = tok.backend.encode(prompt_text(prompt, chat, path), add_special_tokens=False).ids
  else:
    ids = encode(prompt)
  if not ids:
    raise ValueError(f"the prompt {prompt!r} encodes to no tokens: give some text")
  return ids
