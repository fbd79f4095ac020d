"""The two kinds of decoder: `Decoder` (what `pf.generate` runs) and `InfillDecoder` (what
`pf.infill` runs), and the host-side check that a decoder is of the kind an entry point runs.

The loop contract of a `Decoder` (one compiled `lax.while_loop` per decoder, batch size,
prompt width and `max_new_tokens`):

    state = decoder.init(fwd, draft, prompts_BxP, prompt_lens_B, max_new_tokens, rng, eos_id)
    while st.cond(state):                     # rows left, fewer than max_steps iterations
      state = decoder.step(fwd, draft, state)
    out = st.finish(state)                    # GenerateOutput (st: decoding/state.py)

* `validate(cfg, draft_cfg)` runs on the host before any device work: one clear ValueError
  per bad setting (the decoder's own fields, the model configs it needs).
* `init` prefills the prompts into a cache of `cache_capacity(P, N)` slots, emits the first
  token (from the prefill: `GenerateOutput.prefill_forwards`) and returns a `State`: the shared
  `state.DecodeState` fields (token buffer, lengths, done flags, counters, rng, the
  `accepted` trace of `max_steps(N)` rows) and the decoder's own, declared in its own file.
* `step` is one iteration: a pure function of fixed-shape arrays that emits >= 1 token per
  active row (`state.emit`), never touches a done row's outputs, and counts its target
  (`forwards`) and drafter (`draft_forwards`) passes per row.
* Decoders are frozen dataclasses (`flax.struct.dataclass`): static settings are
  `pytree_node=False` fields, so equal settings share a compilation.

An `InfillDecoder` fills the holes of `[B, N]` canvases: `validate(cfg)`, `init(fwd, canvas,
rng)`, `step(fwd, state)` over `lattice.InfillState`, looped while `lattice.cond(state)`.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from paraflax.decoding import state as st


class _Renamed(abc.ABCMeta):
  """Lets a decoder class map a deprecated call spelling to another class: its
  `_old_spelling(*args, **kwargs)` returns the instance to use, or None."""

  def __call__(cls, *args, **kwargs):
    old = cls.__dict__.get("_old_spelling")
    made = None if old is None else old.__func__(*args, **kwargs)
    return super().__call__(*args, **kwargs) if made is None else made


class Decoder(abc.ABC, metaclass=_Renamed):
  """What `pf.generate` runs (see the module docstring for the loop contract)."""
  uses_draft_model: ClassVar[bool] = False  # True: needs generate(..., draft_model=)
  State: ClassVar[type] = st.DecodeState  # the state type `init` returns and `step` keeps

  @property
  def lookahead(self) -> int:
    """Cache rows a step may commit past the last emitted token (0: one token a step)."""
    return 0

  @property
  def draft_forwards_per_step(self) -> int:
    """Drafter forwards a step runs (0: no separate drafter)."""
    return 0

  def cache_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
    """Cache slots: the prompt buffer, the output and what a step may commit past it."""
    return prompt_len + max_new_tokens + self.lookahead

  def max_steps(self, max_new_tokens: int) -> int:
    """Loop iterations reserved (the `accepted` trace rows)."""
    return st.max_steps(max_new_tokens)

  @abc.abstractmethod
  def validate(self, cfg, draft_cfg) -> None:
    """Host checks of the settings against the model's (and drafter's) config."""

  @abc.abstractmethod
  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens: int, rng, eos_id):
    """Prefill and the first token: a `State`."""

  @abc.abstractmethod
  def step(self, fwd, draft, state):
    """One loop iteration: the next `State`."""


class InfillDecoder(abc.ABC, metaclass=_Renamed):
  """What `pf.infill` runs: fill every HOLE of a `[B, N]` canvas in lattice order."""

  @abc.abstractmethod
  def validate(self, cfg) -> None:
    """Host checks of the settings against the (two-stream) model's config."""

  @abc.abstractmethod
  def init(self, fwd, canvas_BxN, rng):
    """The first model call: a `lattice.InfillState`."""

  @abc.abstractmethod
  def step(self, fwd, state):
    """One draft (and verify) iteration."""


def _describe(decoder) -> str:
  return f"{type(decoder).__name__} {decoder!r}"[:80]


def check_kind(decoder, want: type):
  """`decoder` if it is an instance of `want` (Decoder or InfillDecoder), else a one-line
  TypeError naming the entry point that runs it."""
  if isinstance(decoder, want):
    return decoder
  entry = "pf.generate" if want is Decoder else "pf.infill"
  if isinstance(decoder, type) and issubclass(decoder, (Decoder, InfillDecoder)):
    name = decoder.__name__
    raise TypeError(f"decoder=pf.decoders.{name} is the class: pass an instance, e.g. "
                    f"decoder=pf.decoders.{name}()")
  if isinstance(decoder, InfillDecoder):
    raise TypeError(f"{type(decoder).__name__} is an infill decoder: call "
                    "pf.infill(model, tokens_with_holes, decoder=...), not pf.generate")
  if isinstance(decoder, Decoder):
    raise TypeError(f"{type(decoder).__name__} is a generate decoder: call "
                    "pf.generate(model, prompts, decoder=...), not pf.infill")
  if hasattr(decoder, "sample") and hasattr(decoder, "draft"):
    name, example = type(decoder).__name__, "AR" if want is Decoder else "AnyOrder"
    raise TypeError(f"{name} is a sampler, not a decoder: pass it to one, e.g. {entry}(..., "
                    f"decoder=pf.decoders.{example}(sampler=pf.{name}(...)))")
  raise TypeError(f"decoder must be one of pf.decoders (an instance) for {entry}, got "
                  f"{_describe(decoder)}")
