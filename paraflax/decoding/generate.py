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

from paraflax.decoding import checks, core
from paraflax.decoding import state as st
from paraflax.decoding.checks import prepare_prompts  # noqa: F401  (its old home)
from paraflax.decoding.core import check_setup, decode_loop
from paraflax.parallel import sharding

# Trace counts per decoder class: a retrace per call means a shape or static value changes.
TRACES: collections.Counter = collections.Counter()


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "steps_per_iter"))
def _generate_while(fwd, draft, decoder, prompts, prompt_lens, rng, eos_id, max_new_tokens,
                    steps_per_iter):
  TRACES[type(decoder).__name__] += 1
  out = decode_loop(fwd, draft, decoder, prompts, prompt_lens, rng, eos_id, max_new_tokens,
                    steps_per_iter)
  return sharding.constrain_replicated(out)


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
  decoder, max_new_tokens, eos_E = check_setup(
      cfg, decoder, max_new_tokens, eos_id, None if draft_model is None else draft_model.cfg)
  padded, lengths = checks.prepare_prompts(prompts, cfg.vocab_size, prompt_lengths,
                                           max_prompt_len)
  for who, c in (("model", cfg), ("drafter", getattr(draft_model, "cfg", None))):
    if c is not None and int(lengths.max()) + max_new_tokens > c.max_seq_len:
      raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens "
                       f"({max_new_tokens}) exceeds the {who}'s max_seq_len {c.max_seq_len}")
  rng = checks.key(rng, decoder)
  fwd = st.Forward.of(model)
  draft = None if draft_model is None else st.Forward.of(draft_model)
  eos = jnp.asarray(eos_E)  # traced: another EOS set of the same size reuses the loop
  if mesh is None:
    return (fwd, draft, decoder, jnp.asarray(padded), jnp.asarray(lengths), rng, eos), None
  fwd = fwd.replace(params=sharding.shard_state(fwd.params, mesh))
  draft = None if draft is None else draft.replace(params=sharding.shard_state(draft.params, mesh))
  padded, lengths = sharding.shard_batch((padded, lengths), mesh)
  rng, eos = (sharding.put(x, sharding.replicated(mesh)) for x in (rng, eos))
  return (fwd, draft, decoder, padded, lengths, rng, eos), mesh


def generate(model, prompts: Sequence[Sequence[int]] | np.ndarray, decoder=None,
             max_new_tokens: int = 128, rng=None, eos_id: int | Sequence[int] | None = None,
             draft_model=None, *, prompt_lengths=None, max_prompt_len: int | None = None,
             loop: str = "while", steps_per_iter: int | None = None, mesh=None,
             axis_rules=None) -> st.GenerateOutput:
  """Generate up to `max_new_tokens` per prompt with `decoder` (default: greedy AR).

  prompts: list of token-id lists, or an int array [B, P] (with `prompt_lengths` [B] when
  right-padded). `eos_id`: an EOS id or several (`tok.eos_ids`): a row ends at the first
  token of the set it emits (kept), or None. `loop="python"` runs the Python-loop twin (same
  result, one jitted step per iteration). `steps_per_iter`: decode steps per iteration of the
  compiled loop (None: `core.STEPS_PER_ITER` of the backend, 1 on CPU, 4 on GPU / TPU); the
  result does not depend on it. `mesh`: a `jax.sharding.Mesh` with Explicit or Auto
  axes (default: the mesh of an enclosing `jax.set_mesh`, if any): run sharded over its
  devices, outputs replicated.
  `axis_rules` maps the library's mesh axes onto the mesh's own names, e.g.
  `{"tensor": "model"}` for `jax.make_mesh((2, 4), ("data", "model"))` (see
  `sharding.resolve_mesh`); an unusable mesh is a ValueError before any device work. The
  compiled loop is `pf.generate_fn`'s pure function (host checks here, none there).
  """
  if loop not in ("while", "python"):
    raise ValueError(f"loop must be 'while' or 'python', got {loop!r}")
  checks.integer("steps_per_iter", steps_per_iter, 1, none_ok=True)  # before any device work
  args, resolved = _setup(model, prompts, decoder, max_new_tokens, rng, eos_id, draft_model,
                          prompt_lengths, max_prompt_len, mesh, axis_rules)
  max_new_tokens = int(max_new_tokens)
  unroll = core.resolve_steps_per_iter(steps_per_iter, args[2], max_new_tokens,
                                       model.run.backend())
  with sharding.use_mesh(resolved):
    if loop == "while":
      out = _generate_while(*args, max_new_tokens=max_new_tokens, steps_per_iter=unroll)
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
