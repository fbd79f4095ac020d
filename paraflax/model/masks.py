"""Pure attention-mask builders. A mask is bool `[B, T, K]`: query t may attend key k.

Keys are the cache's S slots followed by the chunk's T tokens (K = S + T). Builders take
structure (lengths, block ids) and return dense arrays, so an accelerator kernel can later
take the structure instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cache_slots(lengths_B: jax.Array, slots: int) -> jax.Array:
  """Valid cache slots `[B, S]`: slot s is visible iff s < lengths[b].

  lengths = [2, 4], S = 5 (slot 4 is the spare, never visible):
      row 0: 1 1 0 0 0
      row 1: 1 1 1 1 0
  """
  return jnp.arange(slots)[None, :] < lengths_B[:, None]


def causal(lengths_B: jax.Array, t: int) -> jax.Array:
  """Padding-aware causal mask `[B, T, T]` for right-padded chunks (prefill).

  Query i sees key j iff j <= i and j < lengths[b]. lengths = [3], T = 4:
      q0: 1 0 0 0
      q1: 1 1 0 0
      q2: 1 1 1 0
      q3: 1 1 1 0   <- padding query: sees the real tokens only, output ignored
  """
  j = jnp.arange(t)
  tri = j[None, :] <= j[:, None]  # [T, T]
  return tri[None] & (j[None, None, :] < lengths_B[:, None, None])


def block_causal(block_ids_BxT: jax.Array) -> jax.Array:
  """Causal within a block, blind across blocks: `[B, T, T]`.

  Several candidate blocks that share one prefix (the cache) are packed in one chunk; query i
  sees key j iff j <= i and block[j] == block[i]. block ids = [0 0 1 1 1]:
      q0: 1 0 0 0 0
      q1: 1 1 0 0 0
      q2: 0 0 1 0 0
      q3: 0 0 1 1 0
      q4: 0 0 1 1 1
  """
  t = block_ids_BxT.shape[1]
  j = jnp.arange(t)
  tri = j[None, :] <= j[:, None]
  same = block_ids_BxT[:, :, None] == block_ids_BxT[:, None, :]
  return tri[None] & same


def over_cache(cache_lengths_B: jax.Array, slots: int, chunk_BxTxT: jax.Array) -> jax.Array:
  """Prepend the valid cache slots to a chunk mask: `[B, T, S+T]`.

  Every query of the chunk sees all committed slots of its row, then what `chunk` allows:
      lengths = [2], S = 3, chunk = causal(T=2):
      q0: 1 1 0 | 1 0
      q1: 1 1 0 | 1 1
  """
  t = chunk_BxTxT.shape[1]
  prefix = cache_slots(cache_lengths_B, slots)[:, None, :]  # [B, 1, S]
  return jnp.concatenate([jnp.broadcast_to(prefix, (prefix.shape[0], t, slots)), chunk_BxTxT], -1)


def decode(cache_lengths_B: jax.Array, slots: int, t: int) -> jax.Array:
  """A causal chunk of T new tokens after each row's committed cache: `[B, T, S+T]`."""
  b = cache_lengths_B.shape[0]
  return over_cache(cache_lengths_B, slots, causal(jnp.full((b,), t, jnp.int32), t))



def decode_candidates(cache_lengths_B: jax.Array, slots: int, main: int, n: int,
                      c: int) -> jax.Array:
  """A causal main chunk of `main` tokens, then C candidate segments of n tokens each:
  `[B, T, S+T]`, T = main + C*n.

  Every query sees the committed cache; main queries see the main chunk causally; a candidate
  query sees its own segment causally. The candidates are fed at the main chunk's first n
  positions, so several alternatives for one block share one cache prefix without copying
  the cache along the batch axis. lengths = [1], S = 2, main = 3, n = 2, C = 2 (T = 7):
      m0: 1 0 | 1 0 0 0 0 0 0
      m1: 1 0 | 1 1 0 0 0 0 0
      m2: 1 0 | 1 1 1 0 0 0 0
      a0: 1 0 | 0 0 0 1 0 0 0
      a1: 1 0 | 0 0 0 1 1 0 0
      b0: 1 0 | 0 0 0 0 0 1 0
      b1: 1 0 | 0 0 0 0 0 1 1
  """
  b = cache_lengths_B.shape[0]
  ids = jnp.concatenate([jnp.zeros((main,), jnp.int32), 1 + jnp.repeat(jnp.arange(c), n)])
  return over_cache(cache_lengths_B, slots, block_causal(jnp.broadcast_to(ids, (b, ids.size))))

PROMPT, NOISY, CLEAN = 0, 1, 2  # segment kinds of a packed Jacobi Forcing sequence


def noise_aware(kinds_BxT: jax.Array, valid_BxT: jax.Array) -> jax.Array:
  """Jacobi Forcing's noise-aware causal mask over [prompt, noisy_1, noisy_2, ..., clean_1,
  clean_2, ...] (`jacobi_forcing.example`): `[B, T, T]`. Noisy blocks see the prompt, earlier
  noisy blocks and themselves causally; clean blocks see the prompt, earlier clean blocks and
  themselves causally.

  Since each stream's blocks are in order, this is: key k <= query q and (k is prompt or k has
  q's kind), whatever the order of the streams (rows interleaving them, noisy_1, clean_1,
  noisy_2, ..., get the same rule). Prompt p p, noisy n1 n1 n2 n2, clean c1 c1 c2 c2 (T = 10):
      p : 1 . . . . . . . . .      c1: 1 1 . . . . 1 . . .
      p : 1 1 . . . . . . . .      c1: 1 1 . . . . 1 1 . .
      n1: 1 1 1 . . . . . . .      c2: 1 1 . . . . 1 1 1 .
      n1: 1 1 1 1 . . . . . .      c2: 1 1 . . . . 1 1 1 1
      n2: 1 1 1 1 1 . . . . .
      n2: 1 1 1 1 1 1 . . . .
  """
  t = kinds_BxT.shape[1]
  j = jnp.arange(t)
  tri = (j[None, :] <= j[:, None])[None]
  kq, kk = kinds_BxT[:, :, None], kinds_BxT[:, None, :]
  see = (kk == PROMPT) | (kk == kq)
  # padding keys are invisible; a padding query sees itself only (its output is ignored)
  pad_self = ~valid_BxT[:, :, None] & jnp.eye(t, dtype=bool)[None]
  return (tri & see & valid_BxT[:, None, :]) | pad_self


MASKED = 3  # TiDAR's diffusion slots: mask-token inputs drafting the tokens they stand for


def tidar(kinds_BxT: jax.Array, blocks_BxT: jax.Array, valid_BxT: jax.Array | None = None):
  """TiDAR's causal / bidirectional hybrid over CLEAN tokens and MASKED slots: `[B, T, T]`.

  A clean token sees the clean tokens up to itself (chunk order) and no mask slot; a mask
  slot sees every slot of its own block (bidirectionally) and the clean tokens of lower block
  ids. Training on [clean | all-mask copy], block size 2, block ids = position // 2
  (c = clean, m = mask; a block of slots sees the clean prefix strictly before it):
            c0 c1 c2 c3 | m0 m1 m2 m3
      c0:   1  .  .  .  | .  .  .  .
      c1:   1  1  .  .  | .  .  .  .
      c2:   1  1  1  .  | .  .  .  .
      c3:   1  1  1  1  | .  .  .  .
      m0:   .  .  .  .  | 1  1  .  .
      m1:   .  .  .  .  | 1  1  .  .
      m2:   1  1  .  .  | .  .  1  1
      m3:   1  1  .  .  | .  .  1  1
  `valid` (default all True): invalid keys are invisible, except that an invalid query (padding,
  output ignored) sees itself, so no row is empty.
  """
  t = kinds_BxT.shape[1]
  j = jnp.arange(t)
  tri = (j[None, :] <= j[:, None])[None]
  clean_q, clean_k = (kinds_BxT == CLEAN)[:, :, None], (kinds_BxT == CLEAN)[:, None, :]
  mask_q, mask_k = (kinds_BxT == MASKED)[:, :, None], (kinds_BxT == MASKED)[:, None, :]
  bq, bk = blocks_BxT[:, :, None], blocks_BxT[:, None, :]
  see = (clean_q & clean_k & tri) | (mask_q & mask_k & (bq == bk)) | (mask_q & clean_k & (bk < bq))
  if valid_BxT is None:
    return see
  pad_self = ~valid_BxT[:, :, None] & jnp.eye(t, dtype=bool)[None]
  return (see & valid_BxT[:, None, :]) | pad_self


def tidar_train(length: int, block_sizes_B: jax.Array) -> jax.Array:
  """`tidar` over TiDAR's doubled training sequence [clean x_0..x_{L-1} | L mask slots]:
  `[B, 2L, 2L]`. Row b cuts the mask half into blocks of `block_sizes[b]` positions (the last
  one may be shorter); clean token i and slot i both get block id i // block_size."""
  b = block_sizes_B.shape[0]
  ids = jnp.arange(length)[None, :] // block_sizes_B[:, None]  # [B, L]
  kinds = jnp.concatenate([jnp.full((b, length), CLEAN), jnp.full((b, length), MASKED)], 1)
  return tidar(kinds, jnp.concatenate([ids, ids], 1))


def tidar_prefill(prompt_lens_B: jax.Array, p: int, k: int) -> jax.Array:
  """TiDAR's prefill `[B, P+k, P+k]`: right-padded prompts (causal, padding-aware) followed by
  one block of k mask slots that sees each row's whole prompt and itself.
  lengths = [2], P = 3, k = 2:
      p0: 1 . . | . .
      p1: 1 1 . | . .
      --: 1 1 1 | . .   <- padding: output ignored
      m0: 1 1 . | 1 1
      m1: 1 1 . | 1 1
  """
  b = prompt_lens_B.shape[0]
  kinds = jnp.broadcast_to(jnp.array([CLEAN] * p + [MASKED] * k), (b, p + k))
  blocks = jnp.broadcast_to(jnp.array([0] * p + [1] * k), (b, p + k))
  valid = jnp.concatenate([jnp.arange(p)[None, :] < prompt_lens_B[:, None],
                           jnp.ones((b, k), bool)], 1)
  return tidar(kinds, blocks, valid)


def tidar_decode(cache_lengths_B: jax.Array, slots: int, k: int) -> jax.Array:
  """One TiDAR decoding step after each row's cache: `[B, T, S+T]`, T = k + k*k.

  Chunk = [k causal inputs | k mask blocks of k slots]: causal input i is the decided token
  (i = 1) or draft i; mask block j sees the cache, causal inputs 1..j and itself (causal
  input i has block id i, mask block j has id j + 1). lengths = [1], S = 2, k = 2 (T = 6):
      c1: 1 . | 1 . . . . .
      c2: 1 . | 1 1 . . . .
      a1: 1 . | 1 . 1 1 . .   <- block 1: after causal input 1
      a2: 1 . | 1 . 1 1 . .
      b1: 1 . | 1 1 . . 1 1   <- block 2: after causal inputs 1, 2
      b2: 1 . | 1 1 . . 1 1
  The chunk part depends on k only (a constant); the cache part on the lengths.
  """
  b = cache_lengths_B.shape[0]
  kinds = jnp.array([CLEAN] * k + [MASKED] * (k * k))
  blocks = jnp.concatenate([jnp.arange(1, k + 1), jnp.repeat(jnp.arange(2, k + 2), k)])
  chunk = tidar(kinds[None], blocks[None])
  return over_cache(cache_lengths_B, slots, jnp.broadcast_to(chunk, (b,) + chunk.shape[1:]))


def lattice(visible_BxN: jax.Array, valid_BxN: jax.Array | None = None):
  """AS-ARM masks of a teacher-forced sequence (the binary-lattice decomposition, Eq. 4):
  (content `[B, N, N]`, query `[B, N, N]`).

  Visible (prompt) tokens see each other bidirectionally and never a target; targets are
  generated in ascending position order, so a target's content sees the prompt and the
  targets up to itself, and its query the prompt and the targets strictly before it (never
  its own token). A prompt position's query is unused: it sees the prompt like its content.
  visible = [1 0 1 0] (p = prompt, t = target):
      content            query
      p0: 1 . 1 .        p0: 1 . 1 .   <- unused
      t1: 1 1 1 .        t1: 1 . 1 .
      p2: 1 . 1 .        p2: 1 . 1 .   <- unused
      t3: 1 1 1 1        t3: 1 1 1 .
  `valid` (default all True): invalid keys are invisible; an invalid query sees only itself.
  """
  n = visible_BxN.shape[1]
  j = jnp.arange(n)
  vis_k, tgt_q, tgt_k = visible_BxN[:, None, :], ~visible_BxN[:, :, None], ~visible_BxN[:, None, :]
  content = vis_k | (tgt_q & tgt_k & (j[None, :] <= j[:, None])[None])
  query = vis_k | (tgt_q & tgt_k & (j[None, :] < j[:, None])[None])
  if valid_BxN is None:
    return content, query
  pad_self = ~valid_BxN[:, :, None] & jnp.eye(n, dtype=bool)[None]
  keep = valid_BxN[:, None, :] & valid_BxN[:, :, None]
  return (content & keep) | pad_self, (query & keep) | pad_self
