"""Bytes and FLOPs of a compiled program, per run of a computation, from its optimised HLO
text: XLA's cost analysis (`hlo.cost_analysis`) for what XLA emits itself, and a costing of
our own for the custom calls it gives no cost (cuBLAS, cuDNN, Pallas and Mosaic kernels), so a
program does not look cheaper the more of its work moves into custom calls.

  GEMM custom call       FLOPs 2 x |result| x the contracted sizes (its dot dimensions); the
                         GPU and TPU decode layers' and the greedy head's matmuls
                         (`MATMULS`): 2 x rows x their weights' sizes
  attention custom call  FLOPs 4 x |q| x S (S: the keys' length, the longest of k's middle
                         dims), x 2.5 for a backward kernel, x 1/2 when its mask is causal
                         (cuDNN's backend config), or x the tiles it runs of all its tiles:
                         under splash's causal mask those on or below the diagonal of the
                         tiles in its tokamax config (`causal_tiles`), and where its name
                         scope says (`attention.splash_tiles`: a splash call skips a dense
                         mask's empty tiles, those its structure leaves empty in every row);
                         the decode kernels (`decode_attention`, `tpu_decode_attention`):
                         S = cache slots + chunk, and their stacked-cache operands' bytes are
                         one layer's (what they read)
  any other custom call  no FLOPs (data movement: TPU's buffer and concatenation calls)
  every custom call      bytes: its operands plus its results (on a TPU, those in HBM, and
                         none for a call that only places buffers, `kernels.places_buffers`)

A GEMM or attention call whose shapes these rules cannot read is counted in `uncosted`. A
`while` body counts times its trip count (XLA's analysis counts one trip), a conditional its
largest branch.

Two charges of XLA's analysis are taken back (`overcharge`): a fused gather is charged its
whole table (a decode step's embedding lookup of a few rows: the whole embedding, 0.27x a
0.5B model's floor), and a fused in-place scatter its whole buffer twice (a cache commit:
the whole cache); what they touch is the rows they gather or update.

On a TPU, bytes are HBM's (`hbm`): XLA's analysis of the whole text also counts the traffic
of on-chip memories, into which XLA:TPU copies weights ahead of their use.
"""

from __future__ import annotations

import collections
import math
import re

from paraflax import hlo
from paraflax.model import tpu_decode_attention
from paraflax.model.decode_attention import KERNEL_NAME
from paraflax.model import decode_layer, greedy_head, tpu_decode_layer, tpu_greedy_head
from paraflax.perf.compile.hbm import DTYPE_BYTES, Hbm, in_hbm
from paraflax.perf.compile import kernels
from paraflax.perf.compile.kernels import Program, custom_call_class, kernel_name

# the decode attention kernels by class: their stacked-cache operands (read one layer each)
DECODE_CACHES = {f"attention:{KERNEL_NAME}": (4, 5),
                 f"attention:{tpu_decode_attention.KERNEL_NAME}": (5, 6)}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
# our Pallas matmuls by kernel name: (the operands that are rows [M, K], those that are
# weights); the greedy head's second rows are a mixed head's (TiDAR's target: two rows' logits)
MATMULS = {**{name: ((0,), w) for name, w in decode_layer.WEIGHTS.items()},
           **{name: ((0,), w) for name, w in tpu_decode_layer.WEIGHTS.items()},
           **{k.KERNEL_NAME: ((0, 2), (1,)) for k in (greedy_head, tpu_greedy_head)}}
_BACKWARD = re.compile(r"bwd|backward|grad|dkv|dq", re.I)
# tokamax names its op's arguments in the call's metadata: a causal mask there is splash's
# static `CausalMask`, whose tiles above the diagonal the kernel's grid leaves out
_TOKAMAX_CAUSAL = re.compile(r'causal_mask\\?":\{')
# a splash call whose dense mask's structure leaves tiles empty in every row runs in this name
# scope (`attention.splash_tiles`): the tiles it runs of all its tiles
_SPLASH_TILES = re.compile(r"splash_tiles_(\d+)_of_(\d+)")
# and its tile, queries by keys, in the op's config in the metadata (forward, or backward: dkv)
_TOKAMAX_BLOCKS = re.compile(r'block_q(?:_dkv)?\\?":(\d+),\\?"block_kv(?:_dkv)?\\?":(\d+)')


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of each array in a shape's text (a tuple's elements in order)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)
          if t in DTYPE_BYTES]


def nbytes(shape: str) -> float:
  return sum(DTYPE_BYTES[t] * math.prod(d) for t, d in arrays(shape))


class Costs:
  """Bytes, FLOPs and uncosted custom calls per run of a computation of `program`."""

  def __init__(self, program: Program):
    self.program = program
    self.hbm = Hbm(program) if program.platform == "tpu" else None
    self._nbytes = in_hbm if self.hbm else nbytes
    self._xla: dict[str, collections.Counter] = {}
    self._total: dict[str, collections.Counter] = {}

  def xla(self, name: str) -> collections.Counter:
    """XLA's cost analysis of computation `name`: nested while bodies counted one trip; its
    overcharged bytes taken back (`overcharge`); on a TPU, the bytes in HBM (`hbm`)."""
    if name not in self._xla:
      full = hlo.cost_analysis(hlo.as_entry(self.program.text, name))
      moved = (self.hbm.of(name) if self.hbm else
               full.get("bytes accessed", 0.0) - self.overcharge(name))
      self._xla[name] = collections.Counter({"bytes": moved, "flops": full.get("flops", 0.0)})
    return self._xla[name]

  def overcharge(self, name: str) -> float:
    """Bytes XLA's analysis charges computation `name` (and what it runs, once) beyond what
    its fused gathers and in-place scatters touch (module docstring)."""
    out = 0.0
    for ins in self.program.comps[name]:
      if ins.op == "fusion":
        out += _fusion_overcharge(self.program.comps, ins)
      elif ins.op in ("while", "call"):
        names = ([ins.attribute("body").lstrip("%"), ins.attribute("condition").lstrip("%")]
                 if ins.op == "while" else ins.called)
        out += sum(self.overcharge(c) for c in names)
      elif ins.op == "conditional":
        out += max((self.overcharge(c) for c in ins.called), default=0.0)
    return out

  def of(self, name: str | None = None) -> collections.Counter:
    """{"bytes", "flops", "uncosted"} of one run of computation `name` (default: the entry):
    XLA's figures with every while body's trips counted, plus the custom calls'."""
    p = self.program
    name = p.entry if name is None else name
    if name in self._total:
      return self._total[name]
    out = collections.Counter({"uncosted": 0, **self.xla(name)})
    out.update(self._custom_calls(name))
    for ins in p.comps[name]:
      if ins.op == "while":
        body = ins.attribute("body").lstrip("%")
        inner, once = self.of(body), self.xla(body)
        trips = hlo.trip_count(p.comps, name, ins) or 1
        for k in out:
          out[k] += trips * inner[k] - once[k]
      elif ins.op == "conditional":  # XLA's figures count a branch; ours add its custom calls
        out.update(max((self._custom_calls(c) for c in ins.called), key=lambda c: c["bytes"]))
    self._total[name] = out
    return out

  def _custom_calls(self, name: str) -> collections.Counter:
    """Our costs of the custom calls computation `name` runs itself (async-wrapped ones too)."""
    out = collections.Counter()
    comp = self.program.comps[name]
    shapes = {i.name: i.shape for i in comp}
    for ins in comp:
      call = ins
      if ins.op == "async-start":
        inner = self.program.comps[ins.called[0]]
        call = next((i for i in reversed(inner) if i.op not in hlo.FREE), ins)
        shapes.update({i.name: i.shape for i in inner})
      if call.op != "custom-call" or (self.hbm and kernels.places_buffers(call)):
        continue
      flops = custom_call_flops(call, shapes)
      if flops is None:
        out["uncosted"] += 1
        flops = 0.0
      sizes = [self._nbytes(shapes.get(o, "")) for o in call.operands]
      for i in DECODE_CACHES.get(custom_call_class(call), ()):  # reads one layer of the cache
        sizes[i] /= arrays(shapes[call.operands[i]])[0][1][0]
      out["bytes"] += sum(sizes) + self._nbytes(call.shape)
      out["flops"] += flops
    return out


def _fusion_overcharge(comps, fusion: hlo.Instruction) -> float:
  """A fusion's gathers charged their whole table (a parameter read by the gather alone)
  less the rows they read; its scatters charged their whole buffer in and out less the
  updates they write."""
  out = 0.0
  for name in fusion.called:
    comp = comps.get(name, ())
    by_name = {i.name: i for i in comp}
    users = collections.Counter(o for i in comp for o in i.operands)
    for ins in comp:
      ops = [by_name.get(o) for o in ins.operands]
      if ins.op not in ("gather", "scatter") or not ops or ops[0] is None:
        continue
      table = ops[0]
      if table.op != "parameter" or users[table.name] != 1:
        continue
      if ins.op == "gather":
        out += nbytes(table.shape) - nbytes(ins.shape)
      elif len(ops) >= 3 and ops[2] is not None:
        out += 2 * (nbytes(table.shape) - nbytes(ops[2].shape))
  return out


def causal_tiles(t: int, s: int, block_q: int, block_k: int) -> float:
  """The share of its tiles (`block_q` queries by `block_k` keys) a kernel runs under a causal
  mask over `t` queries and `s` keys: those whose first key is at most their last query."""
  nq, nk = -(-t // block_q), -(-s // block_k)
  return sum(min(nk, ((a + 1) * block_q - 1) // block_k + 1) for a in range(nq)) / (nq * nk)


def custom_call_flops(ins: hlo.Instruction, shapes: dict[str, str]) -> float | None:
  """FLOPs of a custom call (module docstring): a GEMM's and an attention kernel's from their
  shapes, 0 for any other (costed by its bytes); None for a GEMM or attention call whose
  shapes do not say."""
  kind = custom_call_class(ins)
  ops = [arrays(shapes.get(o, "")) for o in ins.operands]
  if kernel_name(ins) in MATMULS:
    row_ops, weights = MATMULS[kernel_name(ins)]
    if len(ops) <= max(weights) or not ops[0]:
      return None
    rows = sum(ops[i][0][1][0] for i in row_ops if i < len(ops))
    return 2.0 * rows * sum(math.prod(ops[i][0][1]) for i in weights)
  if kind == "gemm":
    config = ins.attribute("backend_config") or ""
    contracting = re.search(r'lhs_contracting_dimensions\\?"\s*:\s*\[([^\]]*)\]', config)
    result = arrays(ins.shape)
    if contracting is None or not ops or not ops[0] or not result:
      return None
    lhs = ops[0][0][1]
    dims = [int(d.strip().strip('"\\')) for d in contracting.group(1).split(",") if d.strip()]
    return 2.0 * math.prod(result[0][1]) * math.prod(lhs[d] for d in dims)
  if kind == f"attention:{KERNEL_NAME}":  # q [B, T, Hkv, G, D], chunk k [B, U, ...], the caches
    q, chunk, cache = (arrays(shapes.get(ins.operands[i], ""))[0][1] for i in (0, 1, 4))
    return 4.0 * math.prod(q) * (cache[2] + chunk[1])
  if kind == f"attention:{tpu_decode_attention.KERNEL_NAME}":
    # q [B T, H D], the chunk's mask [B, T, T], the caches [L, B, Hkv, D, S]
    q, seen, cache = (arrays(shapes.get(ins.operands[i], ""))[0][1] for i in (0, 4, 5))
    return 4.0 * math.prod(q) * (cache[-1] + seen[-1])
  if kind.startswith("attention:"):  # q and k: the first two floating operands of rank >= 3
    qk = [a[0][1] for a in ops if a and a[0][0] in ("bf16", "f16", "f32") and len(a[0][1]) >= 3]
    if len(qk) < 2:
      return None
    q, k = qk[:2]  # [B, T, H, D] and [B, S, Hkv, D] (cuDNN), [H, T, D] and [Hkv, S, D] (splash)
    flops = 4.0 * math.prod(q) * max(k[1:-1])
    target = (ins.attribute("custom_call_target") or "") + " " + (kind or "")
    if _BACKWARD.search(target):
      flops *= 2.5
    config = ins.attribute("backend_config") or ""
    if tiles := _SPLASH_TILES.search(ins.rest):
      flops *= int(tiles.group(1)) / int(tiles.group(2))
    elif _TOKAMAX_CAUSAL.search(ins.rest) and (blocks := _TOKAMAX_BLOCKS.search(ins.rest)):
      flops *= causal_tiles(max(q[1:-1]), max(k[1:-1]), *map(int, blocks.groups()))
    elif re.search(r"causal", config, re.I) or _TOKAMAX_CAUSAL.search(ins.rest):
      flops /= 2
    return flops
  return 0.0
