"""Bytes a TPU program moves through HBM. XLA:TPU keeps buffers in on-chip memories (VMEM,
SMEM: a layout's `S(n)`, n >= 1) and moves weights and cache slices into them with
asynchronous copies ahead of their use (memory-space assignment). XLA's cost analysis of the
whole text counts every access wherever its buffer lies: a weight prefetched into VMEM is
charged for the copy's read, its write and the kernel's read. Here each instruction is
charged only what it reads or writes in HBM (memory space 0):

  async slice or copy   the bytes it moves, once for each of its ends in HBM
  custom call           left to `costs` (its operands and results in HBM)
  on chip alone         nothing (operands and results all outside HBM)
  any other             XLA's cost analysis of the instruction alone (its operands made
                        parameters) less what it charges the operands and outputs on chip; a
                        fusion's on-chip operands become constants inside it instead, as
                        XLA's per-operand figures for a fusion mix in its fused ops'

Nested computations count as XLA's analysis counts them: a while's body and condition once,
a conditional's largest branch.
"""

from __future__ import annotations

import math
import re

from paraflax import hlo

# bytes of an element of each HLO type
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s4": 0.5, "u4": 0.5, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
               "c64": 8, "c128": 16, "token": 0}

_ELEMENT = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")
_STACK_FRAME = re.compile(r"\s*stack_frame_id=\d+")
_ASYNC_MOVES = {"slice-start": (0, 1), "copy-start": (1, 0)}  # (source, destination) elements


def elements(shape: str) -> list[tuple[float, bool]]:
  """(bytes, in HBM) of each array of a shape's text, a tuple's in order."""
  return [(DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d),
           not _ON_CHIP.search(layout or ""))
          for t, dims, layout in _ELEMENT.findall(shape) if t in DTYPE_BYTES]


def in_hbm(shape: str) -> float:
  """Bytes of a shape's arrays that lie in HBM."""
  return sum(b for b, hbm in elements(shape) if hbm)


class Hbm:
  """HBM bytes per run of a computation of a TPU `kernels.Program` (module docstring)."""

  def __init__(self, program):
    self.program = program
    self.fallbacks = 0  # instructions XLA's parser refused alone: charged operands + result
    self._of: dict[str, float] = {}

  def of(self, name: str) -> float:
    if name not in self._of:
      comps = self.program.comps
      shapes = {i.name: i.shape for i in comps[name]}
      out = 0.0
      for ins in comps[name]:
        if ins.op in hlo.FREE or ins.op.endswith("-done") or ins.op == "custom-call":
          continue
        if ins.op == "while":
          out += sum(self.of(ins.attribute(k).lstrip("%")) for k in ("body", "condition"))
        elif ins.op == "conditional":
          out += max((self.of(c) for c in ins.called), default=0.0)
        elif ins.op == "call":
          out += sum(self.of(c) for c in ins.called)
        elif ins.op in _ASYNC_MOVES:
          src, dst = (elements(ins.shape)[i] for i in _ASYNC_MOVES[ins.op])
          out += dst[0] * (src[1] + dst[1])  # what it moves, per end in HBM
        else:
          out += self._alone(ins, shapes)
      self._of[name] = out
    return self._of[name]

  def _alone(self, ins: hlo.Instruction, shapes: dict[str, str]) -> float:
    """XLA's bytes of one instruction, as its own module, less those of its operands and
    outputs on chip (module docstring)."""
    operand_shapes = [shapes[o] for o in ins.operands]
    if not any(hbm for s in (*operand_shapes, ins.shape) for _, hbm in elements(s)):
      return 0.0  # reads and writes on chip alone (XLA's analysis still charges a gather)
    on_chip = {i for i, s in enumerate(operand_shapes)
               if not s.startswith("(") and any(not hbm for _, hbm in elements(s))}
    fused = ins.op == "fusion"
    try:
      cost = hlo.cost_analysis(self._module(ins, operand_shapes, on_chip if fused else set()))
    except Exception:  # an op or attribute only XLA:TPU reads
      self.fallbacks += 1
      return sum(in_hbm(s) for s in operand_shapes) + in_hbm(ins.shape)
    out = cost.get("bytes accessed", 0.0)
    if not fused:
      out -= sum(cost.get(f"bytes accessed{i}{{}}", 0.0) for i in on_chip)
    results = elements(ins.shape)
    if not ins.shape.startswith("("):
      return out - cost.get("bytes accessedout{}", 0.0) * (not results[0][1])
    return out - sum(cost.get(f"bytes accessedout{{{i}}}", 0.0)
                     for i, (_, hbm) in enumerate(results) if not hbm)

  def _module(self, ins: hlo.Instruction, operand_shapes: list[str], inline: set[int]) -> str:
    """A module of `ins` alone: its operands made parameters, the computations it calls; a
    fusion's operands in `inline` made constants inside it."""
    lines, seen = ["HloModule alone"], set()
    kept = [k for k in range(len(operand_shapes)) if k not in inline]

    def add(name: str, constants: set[int] = frozenset()) -> None:
      if name in seen:
        return
      seen.add(name)
      body = self.program.comps[name]
      for i in body:
        for c in i.called:
          add(c)
      lines.append(f"%{name} {{")
      for i in body:
        rest = i.rest
        if i.op == "parameter" and constants:
          k = int(rest.split(")")[0])
          if k in constants:
            lines.append(f"  %{i.name}.zero = {i.shape.split('[')[0]}[] constant(0)")
            lines.append(f"  %{i.name} = {i.shape} broadcast(%{i.name}.zero), dimensions={{}}")
            continue
          rest = f"{kept.index(k)}){rest[rest.index(')') + 1:]}"
        lines.append(f"  {'ROOT ' if i is body[-1] else ''}%{i.name} = {i.shape} {i.op}({rest}")
      lines.append("}")

    for j, c in enumerate(ins.called):
      add(c, inline if j == 0 else frozenset())
    end = hlo.operands_end(ins.rest)
    params = ", ".join(f"%p{k}" for k in kept)
    lines += ["ENTRY %alone {"]
    lines += [f"  %p{k} = {operand_shapes[k]} parameter({n})" for n, k in enumerate(kept)]
    lines += [f"  ROOT %x = {ins.shape} {ins.op}({params}{ins.rest[end:]}", "}"]
    return _STACK_FRAME.sub("", "\n".join(lines))  # the module's frame table is not here
