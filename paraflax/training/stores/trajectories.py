"""Jacobi trajectories for Jacobi Forcing: the model's own greedy Jacobi decoding over fixed-span
blocks, every intermediate state kept, stored with tensorstore.

Block b of a row covers the n positions after the previous block's fixed point. Its state
y_0 (guesses drawn from the row's prompt) is refined by y_{k+1} = argmax model([last, y_k[:-1]])
until y_{k+1} = y_k: the fixed point, which is the greedy AR continuation (at least k tokens are
right after k iterations, so y_n is the fixed point). Then the block's KV is committed and the
next block starts. States after convergence repeat the fixed point, so a block's trajectory is
always `[n + 1, n]`: `traj[0]` the initial guess, `traj[n]` the fixed point.

A store is a directory:
    meta.json       block_size, num_blocks, max_prompt_len, examples, batch_size, source model
    tokenizer.json  the tokenizer of the model that decoded
    progress.json   {"batches": k}: the first k batches are written (collection resumes there)
    prompts/        zarr int32 [N, P] right-padded       prompt_lens/ zarr int32 [N]
    trajectories/   zarr int32 [N, num_blocks, n + 1, n]  iterations/  zarr int32 [N, num_blocks]
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from etils.epath import Path  # stores may live on gs://

from paraflax.decoding.state import Forward, prefill
from paraflax.model import masks
from paraflax.model.cache import commit
from paraflax.parallel import sharding
from paraflax.training.stores import store
from paraflax.training.stores.shares import Share
from paraflax.training.stores.store import META, PROGRESS, TOKENIZER, training_prompts  # noqa: F401

ARRAYS = ("prompts", "prompt_lens", "trajectories", "iterations")


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks"))
def jacobi_trajectories(fwd: Forward, prompts_BxP, prompt_lens_B, rng, *, block_size: int,
                        num_blocks: int):
  """Greedy fixed-span Jacobi decoding of `num_blocks` blocks after each prompt.

  Returns (trajectories [B, num_blocks, n + 1, n], iterations [B, num_blocks]: the state index
  at which each block reached its fixed point).
  """
  n = block_size
  b, p = prompts_BxP.shape
  # the last prompt token is fed with the first block, so the cache holds the rest
  cache, _ = prefill(fwd, prompts_BxP, prompt_lens_B - 1, p + num_blocks * n + 1)
  last = prompts_BxP[jnp.arange(b), prompt_lens_B - 1]  # [B]
  rows = jnp.arange(b)[:, None]

  def one_block(carry, key):
    cache, last = carry
    pick = jax.random.randint(key, (b, n), 0, prompt_lens_B[:, None])
    y0 = prompts_BxP[rows, pick]  # [B, n] guesses: tokens of the prompt
    pos = cache.lengths[:, None] + jnp.arange(n)
    mask = masks.decode(cache.lengths, cache.slots, n)

    def refine(c):
      k, y, traj, _, _ = c
      chunk = jnp.concatenate([last[:, None], y[:, :-1]], 1)
      logits, kv = fwd(chunk, pos, mask, cache)
      new = jnp.argmax(logits, -1).astype(jnp.int32)
      traj = traj.at[jnp.minimum(k + 1, n)].set(new)  # y_{n+1} = y_n: never stored
      return k + 1, new, traj, jnp.any(new != y), kv

    traj = jnp.zeros((n + 1, b, n), jnp.int32).at[0].set(y0)
    _, kv0 = jax.eval_shape(lambda: fwd(jnp.zeros((b, n), jnp.int32), pos, mask, cache))
    kv0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), kv0)
    k, y, traj, _, kv = jax.lax.while_loop(lambda c: c[3], refine, (0, y0, traj, True, kv0))
    # the last forward confirmed the fixed point: its input was [last, y[:-1]], commit it all
    cache = commit(cache, kv, jnp.broadcast_to(jnp.arange(n), (b, n)), jnp.full((b,), n))
    steps = jnp.arange(n + 1)[:, None, None]
    fixed = jnp.all(traj == y[None], -1)  # [n+1, B]: state equals the fixed point
    first = jnp.argmax(fixed, 0)  # [B] iterations this row needed
    traj = jnp.where(steps >= jnp.minimum(k, n), y[None], traj)  # pad with the fixed point
    return (cache, y[:, -1]), (jnp.moveaxis(traj, 0, 1), first)

  _, (traj, iters) = jax.lax.scan(one_block, (cache, last), jax.random.split(rng, num_blocks))
  # [B, nb, n+1, n], [B, nb]: whole on every device (under `sharding.use_mesh`)
  return sharding.constrain_replicated((jnp.moveaxis(traj, 0, 1), iters.T))


@dataclasses.dataclass(frozen=True)
class CollectConfig:
  """What to collect: `examples` prompts of `min_prompt_len..max_prompt_len` tokens from the
  training split, `num_blocks` blocks of `block_size` tokens each."""
  block_size: int = 16
  num_blocks: int = 4
  examples: int = 2048
  min_prompt_len: int = 32
  max_prompt_len: int = 96
  batch_size: int = 64
  seed: int = 0

  def __post_init__(self):
    for name in ("block_size", "num_blocks", "examples", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not 2 <= self.min_prompt_len <= self.max_prompt_len:
      raise ValueError("need 2 <= min_prompt_len <= max_prompt_len, got "
                       f"{self.min_prompt_len}, {self.max_prompt_len}")


def collect(model, tokenizer, tokens: np.ndarray | store.Prompts, out: str | os.PathLike,
            cfg: CollectConfig, *, source: str = "", progress: bool = True, mesh=None,
            axis_rules=None) -> Path:
  """Decode `cfg.examples` prompts with fixed-span Jacobi and store every trajectory
  under `out`: random windows of the token stream `tokens` (`training_prompts`), or chosen
  `store.Prompts` (records' prompts: `examples` becomes their number).
  Resumes a partial store made with the same settings (on any mesh).

  `mesh`, `axis_rules` as for `generate`: the model sharded by the rules, each batch's
  prompts split over the data axes; multi-host, each process writes its rows (`shares.py`)."""
  out = Path(out).expanduser()
  cfg, prompts, lens, chosen = store.chosen_prompts(tokens, cfg)
  n, nb, bs = cfg.block_size, cfg.num_blocks, cfg.batch_size
  if cfg.max_prompt_len + nb * n > model.cfg.max_seq_len:
    raise ValueError(f"max_prompt_len + num_blocks * block_size = "
                     f"{cfg.max_prompt_len + nb * n} exceeds the model's max_seq_len "
                     f"{model.cfg.max_seq_len}")
  meta = {**dataclasses.asdict(cfg), "source": str(source),
          "tokenizer": tokenizer.fingerprint(), **chosen}
  shapes = {"prompts": ((cfg.examples, cfg.max_prompt_len), (bs, cfg.max_prompt_len)),
            "prompt_lens": ((cfg.examples,), (bs,)),
            "trajectories": ((cfg.examples, nb, n + 1, n), (bs, nb, n + 1, n)),
            "iterations": ((cfg.examples, nb), (bs, nb))}
  share = Share(sharding.resolve_mesh(mesh, axis_rules), bs)
  fwd = Forward.of(share.place(model))
  key = jax.random.key(cfg.seed)  # one key per batch, whatever the mesh: the same store

  def make(i, lo, hi):
    pb, lb = share.batch(*(store.padded_batch(a, lo, hi, bs) for a in (prompts, lens)))
    with sharding.use_mesh(share.mesh):
      traj, iters = jax.device_get(jacobi_trajectories(
          fwd, pb, lb, share.whole(jax.random.fold_in(key, i)), block_size=n, num_blocks=nb))
    return {"prompts": prompts[lo:hi], "prompt_lens": lens[lo:hi],
            "trajectories": traj[:hi - lo], "iterations": iters[:hi - lo]}

  with share.writing(out, what="trajectory store"):
    arrays, done = share.open_store(out, meta, shapes, tokenizer, what="trajectory store")
    store.fill(out, arrays, meta, done, make, desc=f"trajectories n={n}", progress=progress,
               postfix=lambda r: {"iters_per_block": f"{r['iterations'].mean():.1f}/{n}"},
               share=share)
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectories:
  """A complete store read into memory."""
  meta: dict
  prompts: np.ndarray  # [N, P]
  prompt_lens: np.ndarray  # [N]
  trajectories: np.ndarray  # [N, num_blocks, n + 1, n]
  iterations: np.ndarray  # [N, num_blocks]

  @property
  def fixed_points(self) -> np.ndarray:
    return self.trajectories[:, :, -1]  # [N, num_blocks, n]


def load(path: str | os.PathLike) -> Trajectories:
  """Read a store; refuses one whose collection has not finished."""
  meta, arrays = store.read_store(path, ARRAYS, what="trajectory store",
                                  command="collect-trajectories")
  return Trajectories(meta=meta, **arrays)
