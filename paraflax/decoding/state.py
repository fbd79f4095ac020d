"""Loop state shared by all decoders, and the helpers every decoder uses.

A decoder (`protocol.Decoder`) is `init` (prefill + first token) and `step` (one iteration),
run by `lax.while_loop(cond, step, init)` or by the Python-loop twin in `generate.py`. Its
state is `DecodeState` or a subclass declaring the decoder's own fields in its own file.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from paraflax.model import mask_structure
from paraflax.model.cache import ChunkKV, KVCache, commit, init_cache
from paraflax.model.config import ModelConfig
from paraflax.parallel.sharding import axes, subtree


@struct.dataclass
class Forward:
  """A model split at the jit boundary: `graphdef` is static, `params` is traced."""
  graphdef: Any = struct.field(pytree_node=False)
  cfg: ModelConfig = struct.field(pytree_node=False)
  params: Any = None
  scope: str = struct.field(pytree_node=False, default="target")  # its `jax.named_scope`

  @classmethod
  def of(cls, model: nnx.Module) -> "Forward":
    graphdef, params = nnx.split(model)
    return cls(graphdef=graphdef, cfg=model.cfg, params=params)

  @property
  def backend(self) -> str:
    """The platform the model runs for (its run control's, else this host's)."""
    return nnx.merge(self.graphdef, self.params).run.backend()

  def __call__(self, tokens, positions, mask, cache=None, queries=None):
    with jax.named_scope(self.scope):  # a compiled step's kernels, by model (`perf compile`)
      return nnx.merge(self.graphdef, self.params)(tokens, positions, mask, cache, queries)

  def at(self, tokens, positions, mask, rows_BxN):
    """(float32 logits `[B, N, V]` at chunk rows `rows`, ChunkKV): the output head only where
    a caller reads it (a prefill reads one row per prompt, not `[B, P, V]`: 1.2 GB a row at
    2,000 tokens of a 152k vocabulary)."""
    with jax.named_scope(self.scope):
      model = nnx.merge(self.graphdef, self.params)
      x, kv = model(tokens, positions, mask, hidden=True)
      return model.head(jnp.take_along_axis(x, rows_BxN[:, :, None], axis=1)), kv

  def argmax(self, tokens, positions, mask, cache=None, mix=None):
    """(int32 greedy tokens `[B, T]`: the argmax of each row's logits, ChunkKV), without
    float32 logits where the model's head kernel runs (`Transformer.argmax`, `mix` too)."""
    with jax.named_scope(self.scope):
      model = nnx.merge(self.graphdef, self.params)
      x, kv = model(tokens, positions, mask, cache, hidden=True)
      return model.argmax(x, mix), kv

  def in_compute_dtype(self) -> "Forward":
    """The weights wider than the compute dtype cast to it (float32 parameters of a bf16
    model), once before a loop: every layer casts its weights to the compute dtype before
    using them, so the result is the same and a step reads each weight in that dtype."""
    dt = self.cfg.compute_dtype
    narrow = lambda w: (w.astype(dt) if jnp.issubdtype(w.dtype, jnp.floating)
                        and w.dtype.itemsize > jnp.dtype(dt).itemsize else w)
    return self.replace(params=jax.tree.map(narrow, self.params))


@struct.dataclass
class PendingCommit:
  """Rows of the last step's chunk to commit at the start of the next step.

  Committing before the forward (write, then read) lets XLA update the cache in place; a
  commit after the forward would race with the later layers' cache reads and XLA would copy
  the whole cache every step.
  """
  kv: ChunkKV = subtree()  # k, v [layers, B, T, Hkv, Dh]
  src: jax.Array = axes("batch", None)  # [B, N] chunk rows to keep
  count: jax.Array = axes("batch")  # [B] how many of them


def no_pending(cache: KVCache, t: int, n: int) -> PendingCommit:
  """An empty commit shaped like a step's chunk (T tokens, up to N kept rows)."""
  layers, b, _, h, d = cache.k.shape
  zeros = jnp.zeros((layers, b, t, h, d), cache.k.dtype)
  return PendingCommit(kv=ChunkKV(k=zeros, v=zeros), src=jnp.zeros((b, n), jnp.int32),
                       count=jnp.zeros((b,), jnp.int32))


def apply_pending(cache: KVCache, p: PendingCommit) -> KVCache:
  """`cache` with the kept rows of `p` committed (any model's cache: target or drafter)."""
  return commit(cache, p.kv, p.src, p.count)


def flush(state: "DecodeState") -> KVCache:
  """The target cache with the previous step's kept rows committed."""
  return apply_pending(state.cache, state.pending)


@struct.dataclass
class DecodeState:
  """The loop state every decoder shares. Every field declares its logical axes
  (`sharding.axes`), which place it on a mesh; a decoder that needs more subclasses it (its
  own fields declared the same way)."""
  tokens: jax.Array = axes("batch", None)  # [B, N] generated (N = max_new_tokens), -1 after end
  lengths: jax.Array = axes("batch")  # [B] tokens generated so far
  prompt_lens: jax.Array = axes("batch")  # [B]
  cache: KVCache = subtree()  # the target model's cache, without `pending`
  pending: PendingCommit = subtree()  # last step's kept rows, committed by `flush` next step
  done: jax.Array = axes("batch")  # [B] bool: EOS emitted or N reached
  forwards: jax.Array = axes("batch")  # [B] target forwards (prefill not counted)
  draft_forwards: jax.Array = axes("batch")  # [B] drafter forwards
  accepted: jax.Array = axes(None, "batch")  # [steps, B] emitted per iteration (0 once done)
  step: jax.Array = axes()  # [] iterations run
  rng: jax.Array = axes()  # PRNG key
  eos_id: jax.Array = axes(None)  # [E] int32 EOS ids, -1 padded (matches no token)


@struct.dataclass
class GenerateOutput:
  tokens: jax.Array  # [B, max_new_tokens] int32, -1 after each row's end
  lengths: jax.Array  # [B] int32, EOS included
  forwards: jax.Array  # [B] target-model forwards per row (prefill not counted)
  draft_forwards: jax.Array  # [B] drafter forwards (0 without a separate drafter)
  accepted: jax.Array  # [B, steps] tokens emitted per iteration, for acceptance histograms
  prefill_forwards: jax.Array  # [B] forwards spent on the prompt (1: one padded chunk)


def prefill(fwd: Forward, prompts_BxP, prompt_lens_B, capacity: int):
  """Run the right-padded prompts as one chunk; returns (cache, logits at each row's last
  prompt token [B, V]). Prompt token i of a row lands in cache slot i at position i. The mask
  is the structured causal one: an attention kernel takes it as its own causal mask."""
  b, p = prompts_BxP.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  logits, kv = fwd.at(prompts_BxP, positions, mask_structure.causal(prompt_lens_B, p),
                      prompt_lens_B[:, None] - 1)
  cache = commit(init_cache(fwd.cfg, b, capacity, fwd.backend), kv, positions, prompt_lens_B)
  return cache, logits[:, 0]


def max_steps(max_new_tokens: int) -> int:
  """Loop iterations to reserve: every step emits >= 1 token and the first comes from the
  prefill; keep one (idle) trace row when none are left."""
  return max(max_new_tokens - 1, 1)


def new_state(tokens_shape, prompt_lens, cache, pending, steps: int, rng, eos_id,
              cls: type = DecodeState, **fields) -> DecodeState:
  """A fresh `cls` state (DecodeState or a decoder's subclass, its own `fields` given)."""
  b, n = tokens_shape
  zeros = jnp.zeros((b,), jnp.int32)
  return cls(
      tokens=jnp.full((b, n), -1, jnp.int32), lengths=zeros, prompt_lens=prompt_lens,
      cache=cache, pending=pending, done=jnp.zeros((b,), bool), forwards=zeros,
      draft_forwards=zeros,
      accepted=jnp.zeros((steps, b), jnp.int32), step=jnp.zeros((), jnp.int32), rng=rng,
      eos_id=jnp.atleast_1d(jnp.asarray(eos_id, jnp.int32)), **fields)


def start(fwd: Forward, prompts_BxP, prompt_lens_B, *, capacity: int, max_new_tokens: int,
          chunk: int, keep: int, sampler, rng, eos_id, cls: type = DecodeState,
          prefilled: tuple | None = None, **fields) -> DecodeState:
  """Prefill, sample the first token from the last prompt logits, and build the loop state
  (`cls` with its own `fields`) with an empty pending commit shaped for a step's chunk
  (`chunk` tokens, `keep` rows). `prefilled`: (cache, logits at each row's last prompt token
  [B, V]) of a prefill the decoder ran itself (default: `prefill`)."""
  if prefilled is None:
    prefilled = prefill(fwd, prompts_BxP, prompt_lens_B, capacity)
  cache, logits = prefilled
  rng, sub = jax.random.split(rng)
  first = sampler.sample(sub, logits)
  state = new_state((prompts_BxP.shape[0], max_new_tokens), prompt_lens_B, cache,
                    no_pending(cache, chunk, keep), max_steps(max_new_tokens), rng, eos_id,
                    cls, **fields)
  return emit(state, first[:, None], jnp.ones_like(prompt_lens_B), record=False)[0]


def write_rows(buf_BxL: jax.Array, start_B: jax.Array, new_BxK: jax.Array,
               count_B: jax.Array) -> jax.Array:
  """buf[b, start[b] + i] = new[b, i] for i < count[b] (one scatter; the rest dropped)."""
  b, k = new_BxK.shape
  i = jnp.arange(k)[None, :]
  dst = jnp.where(i < count_B[:, None], start_B[:, None] + i, buf_BxL.shape[1])
  return buf_BxL.at[jnp.arange(b)[:, None], dst].set(new_BxK, mode="drop")


def emit(state: DecodeState, new_BxK: jax.Array, count_B: jax.Array, record=True):
  """Append `new[b, :count[b]]` to each active row, cut at the first token of the EOS set
  (kept) and at the buffer end; mark rows done; record this iteration's count. Returns
  (state, kept [B])."""
  k = new_BxK.shape[1]
  n_max = state.tokens.shape[1]
  i = jnp.arange(k)[None, :]
  count = jnp.where(state.done, 0, jnp.minimum(count_B, n_max - state.lengths))
  is_eos = (new_BxK[..., None] == state.eos_id).any(-1) & (i < count[:, None])
  hit_eos = jnp.any(is_eos, -1)
  count = jnp.where(hit_eos, jnp.argmax(is_eos, -1) + 1, count)
  lengths = state.lengths + count
  accepted = state.accepted.at[state.step].add(count, mode="drop") if record else state.accepted
  state = state.replace(
      tokens=write_rows(state.tokens, state.lengths, new_BxK, count), lengths=lengths,
      done=state.done | hit_eos | (lengths >= n_max), accepted=accepted)
  return state, count


def last_tokens(state: DecodeState) -> jax.Array:
  """The most recent emitted token of each row: [B]."""
  idx = jnp.maximum(state.lengths - 1, 0)[:, None]
  return jnp.take_along_axis(state.tokens, idx, 1)[:, 0]


def cond(state: DecodeState) -> jax.Array:
  return jnp.any(~state.done) & (state.step < state.accepted.shape[0])


def finish(state: DecodeState) -> GenerateOutput:
  b = state.lengths.shape[0]
  return GenerateOutput(
      tokens=state.tokens, lengths=state.lengths, forwards=state.forwards,
      draft_forwards=state.draft_forwards, accepted=state.accepted.T,
      prefill_forwards=jnp.ones((b,), jnp.int32))
