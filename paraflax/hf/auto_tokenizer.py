"""Whether transformers' `AutoTokenizer` encodes a Hugging Face directory as paraflax does.

paraflax reads `tokenizer.json` as it is. transformers 5 rebuilds some model types'
tokenizers from the vocabulary with that family's own pre-tokenizer (see `export.py`), so a
directory can give other ids under `AutoTokenizer`: exports carry what prevents it, and a
user's directory where it happens gets one warning line (`check`). The comparison runs on
`probe_texts`: code with indentation and blank lines, unicode (composed and decomposed),
digits, whitespace runs, the tokenizer's special and method tokens inside text, and a chat
turn under the directory's template; ids must agree, and so must the text of every id.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

PROBES = (
    "def total(xs):\n    return sum(x * 2 for x in xs)\n\n\nclass A:\n\tpass\n",
    "if x:\n        y = {'k': [1, 2]}  # nested\r\n    else:  \n  z = 12345678 + 0.5e-10\n",
    "héllo wörld \u2014 e\u0301 \u00e9 日本語 Ω≈ç√ 😀\u200b end",
    "   leading spaces, trailing   \n\n\n",
)
MESSAGES = [{"role": "system", "content": "Answer in code."},
            {"role": "user", "content": "def add(a, b):\n    return"},
            {"role": "assistant", "content": " a + b\n"}]


class TokenizerWarning(UserWarning):
  """A checkpoint's tokenizer files mean different ids to transformers and to paraflax."""


def probe_texts(tok, chat_template: str | None = None) -> list[str]:
  """`PROBES`, every special and added token of `tok` (a paraflax `Tokenizer`) inside text,
  and `MESSAGES` under `chat_template` (with the reply's turn opened)."""
  added = [t.content for t in tok.backend.get_added_tokens_decoder().values()]
  texts = list(PROBES) + [f"a{t}b\n{t} {t}" for t in added]
  if chat_template is not None:
    from paraflax.data.chat import render_chat
    texts += [render_chat(chat_template, MESSAGES[:-1]),
              render_chat(chat_template, MESSAGES, add_generation_prompt=False)]
  return texts


def differences(auto, tok, texts) -> str | None:
  """The first way the transformers tokenizer `auto` and the paraflax `tok` disagree: a
  text's ids (without and with the special tokens a prompt gets), or the text of ids; None
  when they agree on all `texts` and on every id."""
  for text in texts:
    for special in (False, True):
      ours = tok.backend.encode(text, add_special_tokens=special).ids
      theirs = auto(text, add_special_tokens=special)["input_ids"]
      if ours != theirs:
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                 min(len(ours), len(theirs)))
        return (f"{text[:24]!r}... gives ids {theirs[i:i + 3]} from position {i} where "
                f"tokenizer.json gives {ours[i:i + 3]}")
    if auto.decode(ours) != tok.decode(ours):
      return f"the ids of {text[:24]!r}... decode to {auto.decode(ours)[:24]!r}..."
  every = list(range(tok.vocab_size))
  if auto.decode(every) != tok.decode(every):
    return "the vocabulary's ids decode to other text"
  return None


def load_auto_tokenizer(path: str | os.PathLike):
  """`AutoTokenizer.from_pretrained(path)`, quietly (transformers' own log lines silenced)."""
  import transformers
  verbosity = transformers.logging.get_verbosity()
  transformers.logging.set_verbosity_error()
  try:
    return transformers.AutoTokenizer.from_pretrained(os.fspath(path))
  finally:
    transformers.logging.set_verbosity(verbosity)


def _mismatch(path: Path, tok) -> str | None:
  try:
    auto = load_auto_tokenizer(path)
  except Exception:  # noqa: BLE001  transformers cannot load it at all: nothing to compare
    return None
  from paraflax.data.chat import chat_template
  why = differences(auto, tok, probe_texts(tok, chat_template(path)))
  return None if why is None else f"{type(auto).__name__} ({why})"


_CHECKED: dict[tuple, str | None] = {}  # (directory, its files' mtimes, tokenizer) -> finding


def check(path: str | os.PathLike, tok) -> None:
  """Warn (`TokenizerWarning`, one line) when transformers' `AutoTokenizer` tokenizes the
  Hugging Face directory `path` differently from its tokenizer.json, which paraflax uses (as
  `tok`). Nothing without transformers installed; each directory is compared once."""
  if importlib.util.find_spec("transformers") is None:
    return
  path = Path(path).expanduser().resolve()
  files = ("tokenizer.json", "tokenizer_config.json", "config.json")
  key = (path, tuple((path / n).stat().st_mtime_ns for n in files if (path / n).is_file()),
         tok.fingerprint())
  if key not in _CHECKED:
    _CHECKED[key] = _mismatch(path, tok)
  found = _CHECKED[key]
  if found:
    warnings.warn(f"{str(path)!r} tokenizes differently under transformers' AutoTokenizer, "
                  f"which loads {found}; paraflax uses its tokenizer.json", TokenizerWarning,
                  stacklevel=3)
