"""The pure generate core: `decode_loop` (the compiled loop of every `pf.generate` call) and
`generate_fn`, the same loop as a pure function of (params, prompts, lengths, rng) that users
put inside their own `jax.jit`, under a mesh, or through `jax.export`."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from paraflax.decoding import checks
from paraflax.decoding import state as st
from paraflax.decoding.autoregressive import AR
from paraflax.decoding.protocol import Decoder, check_kind
from paraflax.parallel import sharding

# `steps_per_iter=None`: decode steps per `while_loop` iteration on each backend. XLA:GPU copies
# the loop condition to the host every iteration (a round trip of the order of a small model's
# step), so GPUs and TPUs run several steps per iteration; on CPU the condition is free and each
# unrolled step is compiled again.
STEPS_PER_ITER = {"cpu": 1}
STEPS_PER_ITER_ACCELERATOR = 4


def resolve_steps_per_iter(value: int | None, decoder: Decoder, max_new_tokens: int,
                           backend: str | None = None) -> int:
  """The decode steps per loop iteration for `value` (None: `STEPS_PER_ITER` of `backend`, the
  model's `RunControl.backend()`; None: the default backend), at most the loop's step budget;
  anything but an int >= 1 or None is a ValueError."""
  n = checks.integer("steps_per_iter", value, 1, none_ok=True)
  if n is None:
    n = STEPS_PER_ITER.get(backend or jax.default_backend(), STEPS_PER_ITER_ACCELERATOR)
  return min(n, decoder.max_steps(max_new_tokens))


def run_steps(decoder: Decoder, fwd, draft, state, n: int):
  """`n` decoder steps, statically unrolled (one loop iteration). A row that ends inside the
  iteration is frozen by its done flag (a step never touches a done row's outputs), and once
  the loop's step budget is spent every row counts as done, so the result equals that of one
  step per iteration; at most n - 1 forwards at the end of a call serve no row."""
  for i in range(n):
    if i:  # `st.cond` checked the budget of the iteration's first step only
      state = state.replace(done=state.done | (state.step >= state.accepted.shape[0]))
    state = decoder.step(fwd, draft, state)
  return state


def decode_loop(fwd: st.Forward, draft: st.Forward | None, decoder: Decoder, prompts_BxP,
                prompt_lens_B, rng, eos_id, max_new_tokens: int,
                steps_per_iter: int = 1) -> st.GenerateOutput:
  """`decoder.init`, then `decoder.step` in a `lax.while_loop` until every row is done,
  `steps_per_iter` steps per iteration (`run_steps`); traceable (no host work), one
  compilation per decoder, B, P, `max_new_tokens` and `steps_per_iter`. `eos_id`: int32 [E]
  (or []) EOS ids, -1 for none. Weights wider than the compute dtype are cast to it first
  (`Forward.in_compute_dtype`)."""
  fwd = fwd.in_compute_dtype()
  draft = None if draft is None else draft.in_compute_dtype().replace(scope="drafter")
  state = decoder.init(fwd, draft, prompts_BxP, prompt_lens_B, max_new_tokens, rng, eos_id)
  state = sharding.constrain(state)  # no-op without a mesh
  state = jax.lax.while_loop(
      st.cond, lambda s: run_steps(decoder, fwd, draft, s, steps_per_iter), state)
  return st.finish(state)


def check_setup(cfg, decoder, max_new_tokens, eos_id, draft_cfg):
  """Host checks of everything but the prompts and the key: returns (decoder (default AR),
  max_new_tokens, the EOS ids as int32 [E] (`checks.eos_array`)) or raises one clear error."""
  decoder = AR() if decoder is None else check_kind(decoder, Decoder)
  max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
  if decoder.uses_draft_model and draft_cfg is None:
    raise ValueError(f"{type(decoder).__name__} needs draft_model=")
  if not decoder.uses_draft_model and draft_cfg is not None:
    raise ValueError(f"{type(decoder).__name__} does not use a draft_model")
  decoder.validate(cfg, draft_cfg)
  eos_E = checks.eos_array(checks.eos_ids(eos_id, cfg.vocab_size))
  return decoder, max_new_tokens, eos_E


def generate_fn(model, decoder: Decoder | None = None, max_new_tokens: int = 128, *,
                eos_id: int | Sequence[int] | None = None, draft_model=None,
                steps_per_iter: int | None = None):
  """`pf.generate`'s compiled loop as a pure function, for your own `jax.jit`, mesh or
  `jax.export`:

      run = pf.generate_fn(model, pf.decoders.Jacobi(8), max_new_tokens=64, eos_id=2)

  `eos_id`: one EOS id or several (a row ends at the first of any), or None.
      out = jax.jit(run)(params, prompts_BxP, lengths_B, rng)   # params = nnx.state(model)

  `steps_per_iter`: decode steps per loop iteration (as for `pf.generate`).

  `model` (and `draft_model`) give the graph and config only (an `nnx.eval_shape` model
  will do); the weights are the `params` (and `draft_params`) arguments. The decoder and its
  settings are checked here, once; the returned
  `fn(params, prompts_BxP, lengths_B, rng, draft_params=None) -> GenerateOutput` does no host
  work: prompts are int32 [B, P] right-padded, lengths int32 [B] in 1..P, rng a typed key or
  raw key data (uint32 [2]); each length + max_new_tokens must fit the model's max_seq_len
  (unchecked here: `pf.generate` checks it). Its result equals `pf.generate` on the same
  padded prompts (which pads P to a power of two >= 8: `checks.prepare_prompts`).
  """
  decoder, max_new_tokens, eos_E = check_setup(
      model.cfg, decoder, max_new_tokens, eos_id,
      None if draft_model is None else draft_model.cfg)
  unroll = resolve_steps_per_iter(steps_per_iter, decoder, max_new_tokens, model.run.backend())
  graphdef, cfg = nnx.split(model)[0], model.cfg
  draft_def = None if draft_model is None else (nnx.split(draft_model)[0], draft_model.cfg)

  def fn(params, prompts_BxP, lengths_B, rng, draft_params=None) -> st.GenerateOutput:
    if (draft_params is None) != (draft_def is None):
      raise ValueError(f"{type(decoder).__name__}: pass draft_params exactly when a "
                       "draft_model was given to generate_fn")
    if prompts_BxP.ndim != 2 or lengths_B.shape != prompts_BxP.shape[:1]:
      raise ValueError(f"prompts [B, P] and lengths [B] expected, got shapes "
                       f"{tuple(prompts_BxP.shape)} and {tuple(lengths_B.shape)}")
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
      rng = jax.random.wrap_key_data(rng)
    fwd = st.Forward(graphdef=graphdef, cfg=cfg, params=params)
    draft = None if draft_def is None else st.Forward(*draft_def, params=draft_params)
    return decode_loop(fwd, draft, decoder, prompts_BxP.astype(jnp.int32),
                       lengths_B.astype(jnp.int32), rng, jnp.asarray(eos_E), max_new_tokens,
                       unroll)

  return fn
