"""TiDAR decoding: draft in diffusion and verify autoregressively in one forward per step.

Each step feeds T = k + k*k tokens (k = block size) after the cache (`masks.tidar_decode`):

    [x, d_2..d_k]           causal inputs: the decided next token x, then the k-1 drafts
    [m m .. m] x k blocks   mask block j sees the cache and causal inputs 1..j; its slot i
                            stands for the position i after causal input j

The AR logits at causal input i and the diffusion logits of slot 1 of block i predict the
same token (the one after input i); their mix beta * AR + (1 - beta) * diffusion is the
target. `verify.verify` accepts n drafts (j = n + 1 causal inputs) and decides the next
token: the target at input k when all drafts pass, else a sample from the residual
max(0, p - q) at the first rejection. Slots 2..k of block j (conditioned on exactly the
accepted inputs) are the next drafts, sampled from their sampler-warped distribution q (argmax
when greedy), and that q is kept for the next step's verification. Only the j accepted causal
inputs' keys/values are committed; mask slots never are.

The prefill runs the prompt with one mask block after it (`mask_structure.tidar_prefill`), so
the first token and the first drafts come from the prefill forward (counted in
`prefill_forwards`, as every decoder's prefill is) and every step has drafts. With beta = 1
the targets are the AR distributions: greedy output equals greedy AR, and the stochastic mode
samples the AR joint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from paraflax import verify
from paraflax.decoding import state as st
from paraflax.decoding.protocol import Decoder
from paraflax.model import mask_structure, masks
from paraflax.model.cache import ChunkKV, commit, init_cache
from paraflax.parallel.sharding import axes
from paraflax.sampling import Greedy


@struct.dataclass
class TiDARState(st.DecodeState):
  drafts: jax.Array = axes("batch", None)  # [B, k-1] drafts d_2..d_k for the next step
  q: jax.Array | None = axes("batch", None, None)  # [B, k-1, V] their distributions (None: greedy)


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


@struct.dataclass
class TiDAR(Decoder):
  """TiDAR decoding. `block_size` k: each forward feeds the decided token + k-1 drafts and k
  mask blocks of k slots (k + k*k query slots), emitting 1..k tokens. `beta` in [0, 1] weighs
  the AR logits against the diffusion logits in the target (1: trust AR, exactly the AR
  output; traced, so changing it does not recompile). `sampler`: Greedy() or a stochastic
  sampler (exact speculative sampling of the mixed target)."""
  block_size: int = struct.field(pytree_node=False, default=8)
  beta: float = 1.0
  sampler: object = struct.field(default_factory=Greedy)
  State = TiDARState

  def validate(self, cfg, draft_cfg):
    k, beta = self.block_size, self.beta
    if not _is_int(k) or k < 1:
      raise ValueError(f"TiDAR needs block_size >= 1, got {k!r}")
    if k > cfg.max_seq_len // 2:
      raise ValueError(f"TiDAR block_size {k} is larger than the buffer: a step's mask slots "
                       f"reach 2 * block_size - 1 positions past the cache, more than half the "
                       f"model's max_seq_len ({cfg.max_seq_len})")
    if cfg.mask_token_id is None:
      raise ValueError("TiDAR needs a diffusion-mode model: ModelConfig.mask_token_id is None "
                       "(train one with objective 'tidar' and mask_token_id set)")
    try:
      ok = not isinstance(beta, bool) and 0 <= float(beta) <= 1
    except (TypeError, ValueError):
      ok = False
    if not ok:
      raise ValueError(f"TiDAR needs 0 <= beta <= 1 (1 trusts AR), got {beta!r}")
    self.sampler.validate()

  @property
  def lookahead(self) -> int:
    return self.block_size  # a step commits at most k rows, possibly past max_new_tokens

  def _mix(self, ar_logits, diff_logits):
    return self.beta * ar_logits + (1.0 - self.beta) * diff_logits

  def _greedy(self, fwd, state, tokens, positions, mask, cache):
    """A greedy step from the forward's argmaxes (`Forward.argmax`): AR row j's logits mixed
    with block j's first slot (`_mix`), every slot's own. Returns (n_acc [B], next [B],
    the next drafts [B, k-1]: slots 2..k of block n_acc, ChunkKV)."""
    k, b = self.block_size, tokens.shape[0]
    t = k + k * k
    other = jnp.concatenate([k + k * jnp.arange(k), jnp.arange(k, t)])  # [T]
    a = jnp.concatenate([jnp.full((k,), self.beta, jnp.float32), jnp.ones((k * k,))])
    mix = (jnp.broadcast_to(other, (b, t)), jnp.broadcast_to(a, (b, t)))
    g, kv = fwd.argmax(tokens, positions, mask, cache, mix=mix)
    target, diff = g[:, :k], g[:, k:].reshape(b, k, k)
    if k == 1:
      n_acc, nxt = jnp.zeros((b,), jnp.int32), target[:, 0]
    else:
      n_acc, nxt = verify.greedy_tokens(state.drafts, target)
    drafts = jnp.take_along_axis(diff, n_acc[:, None, None], 1)[:, 0, 1:]
    return n_acc, nxt, drafts, kv

  def init(self, fwd, draft, prompts, prompt_lens, max_new_tokens, rng, eos_id):
    del draft
    k = self.block_size
    b, p = prompts.shape
    capacity = self.cache_capacity(p, max_new_tokens)
    mask_id = fwd.cfg.mask_token_id
    # prompt (positions 0..P-1) + one mask block at each row's next k positions
    tokens = jnp.concatenate([prompts, jnp.full((b, k), mask_id, prompts.dtype)], 1)
    pos_prompt = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    positions = jnp.concatenate([pos_prompt, prompt_lens[:, None] + jnp.arange(k)], 1)
    # logits at each row's last prompt token, then at the mask block's k slots
    read = jnp.concatenate([prompt_lens[:, None] - 1, jnp.broadcast_to(p + jnp.arange(k),
                                                                       (b, k))], 1)
    logits, kv = fwd.at(tokens, positions, mask_structure.tidar_prefill(prompt_lens, p, k), read)
    cache = commit(init_cache(fwd.cfg, b, capacity, fwd.backend), kv, pos_prompt, prompt_lens)
    rng, s_first, s_draft = jax.random.split(rng, 3)
    target = self._mix(logits[:, 0], logits[:, 1])
    first = self.sampler.sample(s_first, target)
    drafts, q = self.sampler.draft(s_draft, logits[:, 2:])
    pending = st.no_pending(cache, k, k)
    state = st.new_state((b, max_new_tokens), prompt_lens, cache, pending,
                         self.max_steps(max_new_tokens), rng, eos_id, TiDARState,
                         drafts=drafts, q=q)
    return st.emit(state, first[:, None], jnp.ones_like(prompt_lens), record=False)[0]

  def step(self, fwd, draft, state: TiDARState) -> TiDARState:
    del draft
    k = self.block_size
    b = state.lengths.shape[0]
    active = ~state.done
    cache = st.flush(state)
    inputs = jnp.concatenate([st.last_tokens(state)[:, None], state.drafts], 1)  # [B, k]
    base = state.prompt_lens + state.lengths - 1  # position of the decided token (== cache len)
    pos_inputs = base[:, None] + jnp.arange(k)
    # block j (0-based) slot i (0-based) stands for the position i + 1 after causal input j
    pos_slots = base[:, None, None] + jnp.arange(k)[:, None] + 1 + jnp.arange(k)[None, :]
    tokens = jnp.concatenate([inputs, jnp.full((b, k * k), fwd.cfg.mask_token_id, jnp.int32)], 1)
    positions = jnp.concatenate([pos_inputs, pos_slots.reshape(b, k * k)], 1)
    mask = masks.tidar_decode(cache.lengths, cache.slots, k)
    rng, s_verify, s_draft = jax.random.split(state.rng, 3)
    if self.sampler.greedy:  # argmaxes only: no logits where the head kernel runs
      n_acc, nxt, new_drafts, kv = self._greedy(fwd, state, tokens, positions, mask, cache)
      new_q = None
    else:
      logits, kv = fwd(tokens, positions, mask, cache)
      v = logits.shape[-1]
      diff_BxKxKxV = logits[:, k:].reshape(b, k, k, v)
      target_BxKxV = self._mix(logits[:, :k], diff_BxKxKxV[:, :, 0])
      if k == 1:  # no drafts: plain sampling from the target
        n_acc = jnp.zeros((b,), jnp.int32)
        nxt = self.sampler.sample(s_verify, target_BxKxV[:, 0])
      else:
        n_acc, nxt = verify.verify(s_verify, self.sampler, state.drafts, state.q, target_BxKxV)
      # slots 2..k of block n_acc (after the accepted inputs) draft the next step
      chosen = jnp.take_along_axis(diff_BxKxKxV, n_acc[:, None, None, None], 1)[:, 0, 1:]
      new_drafts, new_q = self.sampler.draft(s_draft, chosen)
    new = jnp.concatenate([state.drafts, jnp.zeros((b, 1), jnp.int32)], 1)
    new = new.at[jnp.arange(b), n_acc].set(nxt)  # [d_2..d_{n+1}, next, ...]
    src = jnp.broadcast_to(jnp.arange(k), (b, k))
    kv = ChunkKV(k=kv.k[:, :, :k], v=kv.v[:, :, :k])  # causal inputs only: slots never commit
    pending = st.PendingCommit(kv=kv, src=src, count=jnp.where(active, n_acc + 1, 0))
    state = state.replace(cache=cache, pending=pending, rng=rng, drafts=new_drafts, q=new_q,
                          forwards=state.forwards + active)
    state, _ = st.emit(state, new, n_acc + 1)
    return state.replace(step=state.step + 1)
