"""Chat templates of Hugging Face checkpoints, rendered as transformers renders them."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from pathlib import Path

from paraflax.json_io import read_json_object


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


def chat_prompt(path, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
  """The text of `messages` ([{"role", "content"}, ...]) under the chat template of the
  checkpoint at `path` (a ValueError without one): a prompt ending where the assistant's reply
  starts, or with `add_generation_prompt=False` the conversation as it stands (a finished
  one, for training)."""
  template = chat_template(path)
  if template is None:
    raise ValueError(f"{str(path)!r} has no chat template (tokenizer_config.json "
                     "`chat_template` or chat_template.jinja)")
  tokens = {k: v.get("content") if isinstance(v, dict) else v
            for k, v in _tokenizer_config(path).items() if k.endswith("_token")}
  return render_chat(template, messages, add_generation_prompt=add_generation_prompt, **tokens)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A checkpoint's chat template and the special tokens it reads (compiled once)."""

  template: str
  special_tokens: tuple[tuple[str, str], ...] = ()

  @classmethod
  def of(cls, path) -> ChatTemplate | None:
    """The template of the checkpoint directory `path`, or None when it has none."""
    template = chat_template(path)
    if template is None:
      return None
    tokens = {k: v.get("content") if isinstance(v, dict) else v
              for k, v in _tokenizer_config(path).items() if k.endswith("_token")}
    return cls(template, tuple(sorted((k, v) for k, v in tokens.items() if isinstance(v, str))))

  def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """`render_chat` of `messages`."""
    return render_chat(self.template, messages, add_generation_prompt=add_generation_prompt,
                       **dict(self.special_tokens))

  def split(self, messages: list[dict]) -> tuple[str, str]:
    """(prompt, reply) texts of a finished conversation: the rendering of all but its last
    (assistant) message with the assistant's turn opened, and the rest of the whole rendering
    (the reply, its end-of-turn token and what the template writes after it)."""
    prompt = self.render(messages[:-1], add_generation_prompt=True)
    whole = self.render(messages, add_generation_prompt=False)
    if not whole.startswith(prompt):
      raise ValueError("the chat template does not render a conversation as its prompt (the "
                       "messages before the reply, with add_generation_prompt) followed by the "
                       "reply, so the reply's tokens cannot be found")
    return prompt, whole[len(prompt):]


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
  from jinja2 import ext, sandbox  # as transformers: sandboxed, trimmed blocks
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_refuse,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env.from_string(template)


def _refuse(message):
  from jinja2 import TemplateError
  raise TemplateError(message)


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                **special_tokens) -> str:
  """`messages` under the Jinja `template`, with the assistant's turn opened at the end when
  `add_generation_prompt`; `special_tokens` (bos_token="<s>", ...) as the template needs them."""
  from jinja2 import TemplateError
  try:
    return _compiled(template).render(messages=messages,
                                      add_generation_prompt=add_generation_prompt,
                                      **special_tokens)
  except TemplateError as e:
    raise ValueError(f"the chat template failed: {e}") from None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """transformers' `tojson`: Jinja's own escapes HTML characters."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _tokenizer_config(path: Path) -> dict:
  file = Path(path) / "tokenizer_config.json"
  return read_json_object(file) if file.is_file() else {}
