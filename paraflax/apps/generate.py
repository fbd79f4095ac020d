"""Text prompts completed in one batch by any decoder, timed warm: what `paraflax generate`
prints."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax

from paraflax import methods
from paraflax.data.prompts import prompt_ids, prompt_text
from paraflax.decoding.generate import generate
from paraflax.evaluation.methods import sampler_from_flags
from paraflax.loading import load_drafter, load_model
from paraflax.paths import model_dirs


@dataclasses.dataclass(frozen=True)
class Completion:
  prompt: str  # the text completed: as given, or chat messages under the chat template
  text: str  # the new text only
  ids: list[int]  # the new token ids
  forwards: int  # target-model forwards after the prefill (the API's `out.forwards`)
  draft_forwards: int | None  # None: no draft model

  def record(self) -> dict:
    """The completion as a JSON object (`tokens_per_forward` counts the prefill, as the bench)."""
    return dataclasses.asdict(self) | {
        "tokens": len(self.ids), "prefill_forwards": 1,
        "tokens_per_forward": round(len(self.ids) / (self.forwards + 1), 4)}

  def summary(self) -> str:
    """"N tokens: F forwards after the prefill + 1 prefill, R tokens/forward" (+ drafter's)."""
    r = self.record()
    drafted = "" if self.draft_forwards is None else f", {self.draft_forwards} drafter forwards"
    return (f"{r['tokens']} tokens: {self.forwards} forwards after the prefill + 1 prefill, "
            f"{r['tokens_per_forward']:.2f} tokens/forward (prefill included){drafted}")


def complete(prompts: list, *, workdir=None, hf=None, decoder: str = "ar", block_size=None,
             ngram=None, draft=None, chat: bool = False, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, max_new_tokens: int = 64):
  """([Completion], warm seconds): `prompts` (texts, or chat messages) completed in one batch by
  the model of `workdir` or `hf` with the decoder named `decoder` (`paraflax.methods`;
  speculative and deer take the drafter `draft`, a workdir or HF dir). `chat` renders texts as
  one user turn under the model's chat template. Flag errors are ValueErrors raised before any
  model loads."""
  sampler = sampler_from_flags(temperature, top_k, top_p)
  sampler.validate()
  dec = methods.decoder(decoder, sampler, block_size, ngram)
  if bool(draft) != methods.needs_drafter(decoder):
    raise ValueError(f"--decoder {decoder} takes no draft model" if draft else
                     f"--decoder {decoder} needs a draft model: --draft DIR")
  drafter_dirs = model_dirs(draft) if draft else None  # a wrong directory: before any loading
  model, tok, encode = load_model(workdir, hf)
  texts = [prompt_text(p, chat, workdir or hf) for p in prompts]
  ids = [prompt_ids(p, chat, tok, encode, workdir or hf) for p in prompts]
  drafter = None
  if draft:  # drafts stay off padding rows and each model's own method tokens
    drafter, vocab = load_drafter(*drafter_dirs, tok, model)
    dec = dataclasses.replace(dec, vocab=vocab)
  kw = dict(decoder=dec, max_new_tokens=max_new_tokens, rng=jax.random.key(seed),
            eos_id=tok.eos_ids, draft_model=drafter)
  jax.block_until_ready(generate(model, ids, **kw).tokens)  # compile
  t0 = time.perf_counter()
  out = jax.device_get(generate(model, ids, **kw))
  seconds = time.perf_counter() - t0
  rows = [out.tokens[i, :n].tolist() for i, n in enumerate(out.lengths)]
  return [Completion(p, tok.decode(r), r, int(out.forwards[i]),
                     int(out.draft_forwards[i]) if draft else None)
          for i, (p, r) in enumerate(zip(texts, rows))], seconds


def show(done: list[Completion], seconds: float, decoder: str, as_json: bool = False) -> None:
  """Print each completion (its counts on stderr) and the batch's speed; or one JSON object."""
  if as_json:
    print(json.dumps({"decoder": decoder, "seconds": round(seconds, 6),
                      "completions": [c.record() for c in done]}))
    return
  for c in done:
    print(c.prompt + c.text, flush=True)
    print(f"[{c.summary()}]", file=sys.stderr, flush=True)
  tokens = sum(len(c.ids) for c in done)
  print(f"[{len(done)} prompt{'s' * (len(done) > 1)}, {tokens} tokens in {seconds:.3f}s: "
        f"{tokens / seconds:.1f} tokens/s, warm]", file=sys.stderr)
