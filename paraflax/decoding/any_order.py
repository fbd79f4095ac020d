"""Sequential any-subset decoding: one model call per hole, in lattice order (the baseline
ASSD is exact against)."""

from __future__ import annotations

import jax
from flax import struct

from paraflax.decoding import lattice
from paraflax.decoding.lattice import InfillState
from paraflax.decoding.protocol import InfillDecoder
from paraflax.sampling import Greedy


@struct.dataclass
class AnyOrder(InfillDecoder):
  """Sequential any-subset decoding: one model call per hole, in lattice order."""
  sampler: object = struct.field(default_factory=Greedy)
  block = 1
  pending_first = True  # a decided first draft's content is fed with the next call

  def validate(self, cfg):
    lattice.check_two_stream(cfg, "AnyOrder")
    self.sampler.validate()

  def init(self, fwd, canvas_BxN, rng) -> InfillState:
    return lattice.first_call(fwd, self, canvas_BxN, rng)

  def step(self, fwd, state: InfillState) -> InfillState:
    return jax.lax.cond(lattice.cond(state), lambda s: lattice.draft_call(fwd, self, s),
                        lambda s: s, state)
