"""Kernels, the kernel mix and host synchronisations of a compiled program, from its optimised
HLO text (`paraflax.hlo`).

A kernel is an instruction that launches work: a fusion, a custom call (cuBLAS, cuDNN, a
Pallas / Mosaic kernel), a copy, a collective, any unfused op; not a parameter, tuple or
bitcast (`hlo.FREE`). An async pair (`*-start` / `*-done`) counts once, at its start. A
`while` with a known trip count (a `scan` or `fori_loop`) runs its body that many times and
never its condition (XLA:GPU's `WhileThunk`); one without runs condition and body once per
iteration (counted once here). A `conditional` runs one branch: its largest.

Host synchronisations (`syncs`) are what makes a GPU wait for its host: a conditional (its
predicate is copied to the host to pick the branch), a while without a known trip count (its
predicate, every iteration: counted once per run of the loop here), a host callback. A TPU
runs control flow on the chip: there only host callbacks count.

The mix (`mix`), one class per kernel: `gemm` (a fusion with a dot or convolution, a cuBLAS
call), `attention:<kernel>` (an attention custom call, by its kernel's name), `reduction`,
`elementwise`, `copy` (copies, slices, dynamic updates, moves with no arithmetic),
`collective`, `custom:<target>` (another custom call), or the opcode of an unfused op; on a
TPU three classes launch no kernel: unfused ops, the scalar core's work (loop counters,
indices), `scalar`; asynchronous copies and slices, DMAs between HBM and the on-chip memories
that XLA:TPU issues ahead of a kernel's use, `dma`; custom calls that only place buffers
(`ConcatBitcast`, `AllocateBuffer`), `layout`.
`scopes` counts the kernels under each `jax.named_scope` asked for (their `op_name`
metadata), e.g. a decode step's target and drafter forwards.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re

from paraflax import hlo

ATTENTION = re.compile(r"attention|fmha|flash|splash|mha", re.I)
GEMM_CALLS = re.compile(r"cublas|gemm|matmul", re.I)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
MOVES = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy",
                   "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad",
                   "transpose", "broadcast", "reshape", "iota", "convert"})
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# on a TPU: custom calls that only place buffers (a concatenation laid out in place, an
# allocation, an annotation), and the classes that launch no kernel
TPU_LAYOUT_CALLS = frozenset({"ConcatBitcast", "AllocateBuffer", "AssumeGatherIndicesInBound"})
NOT_KERNELS = frozenset({"scalar", "dma", "layout"})


@dataclasses.dataclass
class Count:
  """Kernels, their mix, host synchronisations and the kernels under named scopes."""

  kernels: float = 0.0
  syncs: float = 0.0
  mix: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  scopes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def add(self, other: Count, times: float = 1.0) -> None:
    self.kernels += times * other.kernels
    self.syncs += times * other.syncs
    for mine, theirs in ((self.mix, other.mix), (self.scopes, other.scopes)):
      for k, v in theirs.items():
        mine[k] += times * v


class Program:
  """One optimised module's text, counted per computation (`count`)."""

  def __init__(self, text: str, platform: str, scopes: tuple[str, ...] = ()):
    self.text, self.platform, self.scopes = text, platform, scopes
    self.comps, self.entry = hlo.computations(text)
    self._counts: dict[str, Count] = {}

  def count(self, name: str | None = None, skip: frozenset = frozenset()) -> Count:
    """The kernels computation `name` (default: the entry) launches per run, through the
    computations it runs; instructions named in `skip` are left out (and not cached)."""
    name = self.entry if name is None else name
    if name in self._counts and not skip:
      return self._counts[name]
    out = Count()
    for ins in self.comps[name]:
      if ins.name in skip or ins.op in hlo.FREE or ins.op.endswith("-done"):
        continue
      if ins.op == "while":  # a known trip count runs the body only (XLA:GPU's WhileThunk)
        trips = hlo.trip_count(self.comps, name, ins)
        out.add(self.count(ins.attribute("body").lstrip("%")), trips or 1)
        if trips is None:
          out.add(self.count(ins.attribute("condition").lstrip("%")))
          out.syncs += self.platform == "gpu"
      elif ins.op == "conditional":
        out.add(max((self.count(c) for c in ins.called), key=lambda c: c.kernels))
        out.syncs += self.platform == "gpu"
      elif ins.op == "call":
        for c in ins.called:
          out.add(self.count(c))
      else:
        kind = self.classify(ins)
        if self.platform == "tpu":
          kind = tpu_class(ins, kind)
        out.kernels += kind not in NOT_KERNELS
        out.mix[kind] += 1
        out.syncs += "callback" in kind
        op_name = _OP_NAME.search(ins.rest)
        for scope in self.scopes if kind not in NOT_KERNELS else ():
          if op_name and f"/{scope}/" in op_name.group(1) + "/":
            out.scopes[scope] += 1
    if not skip:
      self._counts[name] = out
    return out

  def classify(self, ins: hlo.Instruction) -> str:
    """The mix class of one kernel (module docstring)."""
    if ins.op == "async-start":  # the op it wraps
      inner = self.comps[ins.called[0]]
      return self.classify(next(i for i in reversed(inner) if i.op not in hlo.FREE))
    if ins.op == "custom-call":
      return custom_call_class(ins)
    if ins.op in ("fusion", "fusion-start"):  # an async fusion: a fusion
      ops = self.fused_ops(ins)
      if ops & {"dot", "convolution"}:
        return "gemm"
      if "custom-call" in ops:
        return "custom:fusion"
      if ops & {"reduce", "reduce-window", "scatter", "select-and-scatter"}:
        return "reduction"
      return "copy" if ops <= MOVES else "elementwise"
    if ins.op in ("copy", "copy-start", "dynamic-update-slice", "dynamic-slice", "slice"):
      return "copy"
    if ins.op.removesuffix("-start") in COLLECTIVES:
      return "collective"
    return ins.op

  def fused_ops(self, ins: hlo.Instruction) -> set[str]:
    """The opcodes inside a fusion, nested fusions and calls included."""
    ops = set()
    for name in ins.called:
      for inner in self.comps.get(name, ()):
        ops.add(inner.op)
        if inner.op in ("fusion", "call"):
          ops |= self.fused_ops(inner)
    return ops


def tpu_class(ins: hlo.Instruction, kind: str) -> str:
  """A TPU's class for a kernel of mix class `kind`: an unfused op is the scalar core's
  (`scalar`), an asynchronous copy or slice a DMA between memories (`dma`), a layout call
  places buffers (`layout`); none of them launches a kernel."""
  if ins.op in ("copy-start", "slice-start"):
    return "dma"
  if places_buffers(ins):
    return "layout"
  return "scalar" if kind == ins.op and ins.op != "copy" else kind


def places_buffers(ins: hlo.Instruction) -> bool:
  """Whether `ins` is a TPU custom call that only places buffers (`TPU_LAYOUT_CALLS`)."""
  return ins.op == "custom-call" and ins.attribute("custom_call_target") in TPU_LAYOUT_CALLS


def custom_call_class(ins: hlo.Instruction) -> str:
  """`gemm`, `attention:<kernel>`, or `custom:<target>` of a custom call: the kernel's name
  from its backend config where the target is generic (a Pallas Triton or Mosaic call)."""
  target = ins.attribute("custom_call_target") or "?"
  name = kernel_name(ins) or target
  if ATTENTION.search(name) or ATTENTION.search(target):
    return f"attention:{'cudnn' if 'cudnn' in target else name}"
  if GEMM_CALLS.search(target) or GEMM_CALLS.search(name):
    return "gemm"
  if "callback" in target:
    return f"callback:{target}"
  return f"custom:{name}"


def kernel_name(ins: hlo.Instruction) -> str | None:
  """The kernel name a Pallas / Mosaic custom call carries in its backend config (JSON, or
  a Pallas Triton call's MLIR attribute dict); a Mosaic kernel's is its call's name, which
  XLA:TPU gives after the kernel (`splash_mha_fwd.8`, `paraflax_tpu_matmul.3.x_ref`)."""
  if ins.attribute("custom_call_target") == "tpu_custom_call":
    return ins.name.split(".")[0]
  config = ins.attribute("backend_config")
  if not config:
    return None
  for key in ("name", "kernel_name"):
    m = re.search(rf'\\?"{key}\\?"\s*:\s*\\?"([^"\\]+)', config)
    if m:
      return m.group(1)
  m = re.search(r'\bname = "([^"]+)"', config)  # a Pallas Triton call's MLIR attributes
  if m:
    return m.group(1)
  try:
    return json.loads(config).get("name")
  except (ValueError, AttributeError):
    return None
