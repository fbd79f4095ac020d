"""Chat templates of Hugging Face checkpoints, rendered as transformers renders them."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from paraflax.json_io import read_json


def chat_template(path) -> str | None:
  """The chat template of the checkpoint directory `path` (`chat_template.jinja`, else
  tokenizer_config.json's `chat_template`, whose named list gives "default"), or None."""
  path = Path(path)
  if (path / "chat_template.jinja").is_file():
    return (path / "chat_template.jinja").read_text(encoding="utf-8")
  template = _tokenizer_config(path).get("chat_template")
  if isinstance(template, list):
    template = {t.get("name"): t.get("template") for t in template}.get("default")
  return template if isinstance(template, str) else None


def chat_prompt(path, messages: list[dict]) -> str:
  """The prompt text of `messages` ([{"role", "content"}, ...]) under the chat template of the
  checkpoint at `path`, ending where the assistant's reply starts (a ValueError without one)."""
  template = chat_template(path)
  if template is None:
    raise ValueError(f"{str(path)!r} has no chat template (tokenizer_config.json "
                     "`chat_template` or chat_template.jinja)")
  tokens = {k: v.get("content") if isinstance(v, dict) else v
            for k, v in _tokenizer_config(path).items() if k.endswith("_token")}
  return render_chat(template, messages, **tokens)


def render_chat(template: str, messages: list[dict], **special_tokens) -> str:
  """`messages` under the Jinja `template` with `add_generation_prompt`; `special_tokens`
  (bos_token="<s>", ...) as the template needs them."""
  from jinja2 import TemplateError, ext, sandbox  # as transformers: sandboxed, trimmed blocks

  def refuse(message):
    raise TemplateError(message)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=refuse,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  try:
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            **special_tokens)
  except TemplateError as e:
    raise ValueError(f"the chat template failed: {e}") from None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """transformers' `tojson`: Jinja's own escapes HTML characters."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _tokenizer_config(path: Path) -> dict:
  file = Path(path) / "tokenizer_config.json"
  return read_json(file) if file.is_file() else {}
