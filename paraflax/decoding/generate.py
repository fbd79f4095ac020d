"""`generate`: validate on the host, then one compiled `lax.while_loop` per decoder shape.

The Python-loop twin (`generate_steps`) runs the same jitted `init`/`step` one iteration at a
time, for streaming, notebooks and tests. With `mesh=` (Explicit or Auto axes; `axis_rules=`
names the axes playing data / fsdp / tensor) or inside `jax.set_mesh`, the mesh is resolved on
the host (`sharding.resolve_mesh`), params and prompts are sharded on entry, and the loop runs
under `sharding.use_mesh` (cache and state placed by their declared logical axes).
"""

from __future__ import annotations

import collections
import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paraflax import sharding
from paraflax.decoding import checks
from paraflax.decoding import state as st
from paraflax.decoding.autoregressive import AR

# Trace counts per decoder class: a retrace per call means a shape or static value changes.
TRACES: collections.Counter = collections.Counter()


def _bucket(n: int) -> int:
  """Pad prompts to a power of two (>= 8) so new prompt lengths rarely retrace."""
  return max(8, 1 << (n - 1).bit_length())


def prepare_prompts(prompts, vocab_size: int, prompt_lengths=None, max_prompt_len=None):
  """Host-side checks and right padding. Returns (prompts int32 [B, P], lengths int32 [B])."""
  rows = checks.token_rows(prompts)
  if prompt_lengths is not None:
    widths = {len(r) for r in rows}
    if len(widths) > 1:
      raise ValueError("prompts [B, P] with prompt_lengths [B] expected, got rows of widths "
                       f"{sorted(widths)}")
    lengths = checks.prompt_lengths(prompt_lengths, len(rows))
    if rows and np.any(lengths > len(rows[0])):
      raise ValueError(f"prompt_lengths {lengths.tolist()} exceed the prompt width {len(rows[0])}")
    rows = [r[:n] for r, n in zip(rows, lengths)]
  lengths = np.array([len(r) for r in rows], np.int32)
  if len(rows) == 0:
    raise ValueError("no prompts given: need a batch of at least one prompt")
  if np.any(lengths < 1):
    raise ValueError(f"empty prompt at batch rows {np.flatnonzero(lengths < 1).tolist()}: "
                     "every prompt needs at least one token")
  longest = int(lengths.max())
  width = _bucket(longest) if max_prompt_len is None else checks.integer(
      "max_prompt_len", max_prompt_len, 1)
  if longest > width:
    raise ValueError(f"prompt of {longest} tokens is longer than the prompt buffer "
                     f"max_prompt_len={width}")
  bad = [(i, t) for i, r in enumerate(rows) for t in r if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"token ids outside the vocabulary [0, {vocab_size}): "
                     f"(row, id) = {bad[:5]}")
  padded = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    padded[i, :len(r)] = r
  return padded, lengths


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def _generate_while(fwd, draft, decoder, prompts, prompt_lens, rng, eos_id, max_new_tokens):
  TRACES[type(decoder).__name__] += 1
  state = decoder.init(fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id)
  state = sharding.constrain(state)  # no-op without a mesh
  state = jax.lax.while_loop(st.cond, lambda s: decoder.step(fwd, draft, s), state)
  return sharding.constrain_replicated(st.finish(state))


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def _init(fwd, draft, decoder, prompts, prompt_lens, rng, eos_id, max_new_tokens):
  state = decoder.init(fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id)
  return sharding.constrain(state)


@jax.jit
def _step(fwd, draft, decoder, state):
  return sharding.constrain(decoder.step(fwd, draft, state))


def _setup(model, prompts, decoder, max_new_tokens, rng, eos_id, draft_model, prompt_lengths,
           max_prompt_len, mesh=None, axis_rules=None):
  """Host checks and placement. Returns (jit arguments, the resolved mesh or None)."""
  cfg = model.cfg
  mesh = sharding.resolve_mesh(mesh, axis_rules)
  decoder = AR() if decoder is None else decoder
  max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
  if decoder.uses_draft_model and draft_model is None:
    raise ValueError(f"{type(decoder).__name__} needs draft_model=")
  if not decoder.uses_draft_model and draft_model is not None:
    raise ValueError(f"{type(decoder).__name__} does not use a draft_model")
  decoder.validate(cfg, None if draft_model is None else draft_model.cfg)
  eos_id = checks.integer("eos_id", eos_id, none_ok=True)
  if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
    raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {cfg.vocab_size})")
  padded, lengths = prepare_prompts(prompts, cfg.vocab_size, prompt_lengths, max_prompt_len)
  if int(lengths.max()) + max_new_tokens > cfg.max_seq_len:
    raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) "
                     f"exceeds the model's max_seq_len {cfg.max_seq_len}")
  rng = checks.key(rng, decoder)
  fwd = st.Forward.of(model)
  draft = None if draft_model is None else st.Forward.of(draft_model)
  eos = jnp.int32(-1 if eos_id is None else eos_id)
  if mesh is None:
    return (fwd, draft, decoder, jnp.asarray(padded), jnp.asarray(lengths), rng, eos), None
  fwd = fwd.replace(params=sharding.shard_state(fwd.params, mesh))
  draft = None if draft is None else draft.replace(params=sharding.shard_state(draft.params, mesh))
  padded, lengths = sharding.shard_batch((padded, lengths), mesh)
  rng, eos = (sharding.put(x, sharding.replicated(mesh)) for x in (rng, eos))
  return (fwd, draft, decoder, padded, lengths, rng, eos), mesh


def generate(model, prompts: Sequence[Sequence[int]] | np.ndarray, decoder=None,
             max_new_tokens: int = 128, rng=None, eos_id: int | None = None, draft_model=None,
             *, prompt_lengths=None, max_prompt_len: int | None = None,
             loop: str = "while", mesh=None, axis_rules=None) -> st.GenerateOutput:
  """Generate up to `max_new_tokens` per prompt with `decoder` (default: greedy AR).

  prompts: list of token-id lists, or an int array [B, P] (with `prompt_lengths` [B] when
  right-padded). `loop="python"` runs the Python-loop twin (same result, one jitted step per
  iteration). `mesh`: a `jax.sharding.Mesh` with Explicit or Auto axes (default: the mesh of
  an enclosing `jax.set_mesh`, if any): run sharded over its devices, outputs replicated.
  `axis_rules` maps the library's mesh axes onto the mesh's own names, e.g.
  `{"tensor": "model"}` for `jax.make_mesh((2, 4), ("data", "model"))` (see
  `sharding.resolve_mesh`); an unusable mesh is a ValueError before any device work.
  """
  if loop not in ("while", "python"):
    raise ValueError(f"loop must be 'while' or 'python', got {loop!r}")
  args, resolved = _setup(model, prompts, decoder, max_new_tokens, rng, eos_id, draft_model,
                          prompt_lengths, max_prompt_len, mesh, axis_rules)
  with sharding.use_mesh(resolved):
    if loop == "while":
      out = _generate_while(*args, max_new_tokens=max_new_tokens)
    else:
      final = None
      for final in _steps(*args, max_new_tokens, resolved):
        pass
      out = st.finish(final)
  return sharding.returned_on(out, mesh, resolved)


def _steps(fwd, draft, decoder, prompts, lens, rng, eos, max_new_tokens, mesh=None):
  # the mesh context is entered per call, never held across a yield
  with sharding.use_mesh(mesh):
    state = _init(fwd, draft, decoder, prompts, lens, rng, eos, max_new_tokens=max_new_tokens)
  yield state
  while True:
    with sharding.use_mesh(mesh):  # eager ops on the state too (the user may hold another mesh)
      if not bool(st.cond(state)):
        break
      state = _step(fwd, draft, decoder, state)
    yield state


def generate_steps(model, prompts, decoder=None, max_new_tokens: int = 128, rng=None,
                   eos_id=None, draft_model=None, *, prompt_lengths=None,
                   max_prompt_len=None, mesh=None, axis_rules=None
                   ) -> Iterator[st.DecodeState]:
  """The Python-loop twin: yields the decoder state after the prefill and after every step
  (`mesh`, `axis_rules` as for `generate`)."""
  args, mesh = _setup(model, prompts, decoder, max_new_tokens, rng, eos_id, draft_model,
                      prompt_lengths, max_prompt_len, mesh, axis_rules)
  yield from _steps(*args, max_new_tokens, mesh)
