"""Reading an optimised HLO module's text: its computations and instructions, the kernels a
computation launches (while bodies times their trip counts), and XLA's cost analysis of one
computation through the CPU client.

Used by `decoding/cost.py` (a decode step on this backend) and `perf/compile` (a program
compiled for a GPU or TPU target). One instruction is one line of the text:

    %fusion.3 = bf16[8,896]{1,0} fusion(%p.1, %p.2), kind=kLoop, calls=%fused_computation.3
"""

from __future__ import annotations

import dataclasses
import re

# instructions that launch no work; `*-done` (and `async-update`) end work their `*-start`
# launched, so an async pair counts once
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                  "after-all", "opt-barrier", "partition-id", "replica-id", "async-update",
                  "add-dependency", "domain"})
CONTROL = frozenset({"while", "conditional", "call"})  # run other computations
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<shape>.*?) "
                          r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLED = re.compile(r"(?:calls|body|to_apply|condition|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
_NAME = re.compile(r"%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str  # the result's shape text, e.g. "bf16[8,896]{1,0}" or a tuple "(f32[], s32[])"
  op: str
  rest: str  # operands and attributes: the text after the opcode's "("

  @property
  def called(self) -> list[str]:
    """Names of the computations this instruction runs (fused, body, branches, applied)."""
    names = _CALLED.findall(self.rest)
    branches = _BRANCHES.search(self.rest)
    if branches:
      names += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
    return names

  @property
  def operands(self) -> list[str]:
    """Its operands' names (the text inside its opcode's parentheses)."""
    return _NAME.findall(self.rest[:operands_end(self.rest)])

  @property
  def trip_count(self) -> int | None:
    """A while's known trip count (a `fori_loop` or `scan`), else None."""
    m = _TRIP_COUNT.search(self.rest)
    return int(m.group(1)) if m else None

  def attribute(self, key: str) -> str | None:
    """The text of attribute `key=`: a quoted string's contents, a braced value (a JSON
    backend config) whole, else up to the next comma."""
    m = re.search(rf'(?:^|[\s,(]){re.escape(key)}=', self.rest)
    if m is None:
      return None
    text = self.rest[m.end():]
    if text.startswith("{"):
      depth, quoted = 0, False
      for i, ch in enumerate(text):
        if ch == '"' and text[i - 1] != "\\":
          quoted = not quoted
        elif not quoted and ch in "{}":
          depth += 1 if ch == "{" else -1
          if depth == 0:
            return text[:i + 1]
      return text
    m = re.match(r'"((?:[^"\\]|\\.)*)"|([^,\s)]*)', text)
    return m.group(1) if m.group(1) is not None else m.group(2)


def operands_end(rest: str) -> int:
  """Where an instruction's operand list ends in its text after the opcode's "(" (`rest`)."""
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch in "({["
    if ch in ")}]":
      if depth == 0:
        return i
      depth -= 1
  return len(rest)


def computations(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
  """The computations of a module's text: (name -> instructions, the entry's name). An
  instruction whose attributes run over several lines (a TPU kernel's metadata) is one."""
  comps, entry, name, lines = {}, None, None, []

  def flush():
    m = _INSTRUCTION.match(" ".join(lines)) if lines else None
    if m:
      comps[name].append(Instruction(**m.groupdict()))
    lines.clear()

  for line in hlo.splitlines():
    if name is None:
      m = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{$", line)
      if m and not line.startswith("HloModule"):
        name = m.group(2)
        comps[name] = []
        entry = name if m.group(1) else entry
    elif line == "}":
      flush()
      name = None
    elif _INSTRUCTION.match(line):
      flush()
      lines.append(line)
    else:
      lines.append(line.strip())  # the rest of the instruction before
  if entry is None:
    raise ValueError("not an HLO module's text: no ENTRY computation")
  return comps, entry


def trip_count(comps: dict[str, list[Instruction]], caller: str, loop: Instruction) -> int | None:
  """The trip count of `while` instruction `loop` in computation `caller`: XLA's
  `known_trip_count` (GPU), else read off a counted loop (TPU): a condition `i < N`, N a
  constant and `i` a tuple element the loop starts at a constant `c` (copied, perhaps): N - c
  trips of a `scan` or `fori_loop`, which step by one. None when it is neither."""
  if loop.trip_count is not None:
    return loop.trip_count
  cond = comps.get(loop.attribute("condition").lstrip("%"), [])
  named = {i.name: i for i in cond}
  root = cond[-1] if cond else None
  if root is None or root.op != "compare" or root.attribute("direction") != "LT":
    return None
  a, b = (named.get(o) for o in root.operands[:2])
  if a is None or b is None or a.op != "get-tuple-element" or b.op != "constant":
    return None
  start = _tuple_operand(comps[caller], loop, int(a.attribute("index")))
  if start is None or start.op != "constant":
    return None
  return _constant(b) - _constant(start)


def _tuple_operand(comp: list[Instruction], loop: Instruction, index: int) -> Instruction | None:
  """The instruction that makes element `index` of a while's initial tuple."""
  named = {i.name: i for i in comp}
  init = named.get(loop.operands[0])
  if init is None or init.op != "tuple":
    return None
  operands = init.operands
  out = named.get(operands[index]) if index < len(operands) else None
  while out is not None and out.op in ("copy", "bitcast"):  # a constant, copied
    out = named.get(out.operands[0])
  return out


def _constant(ins: Instruction) -> int:
  return int(ins.rest.split(")")[0])


def as_entry(hlo: str, name: str) -> str:
  """The module's text with computation `name` as its entry (for XLA's cost analysis)."""
  out = []
  for line in hlo.splitlines():
    if line.startswith("HloModule"):
      line = line.split(",")[0]  # the entry's layout no longer applies
    elif line.startswith("ENTRY "):
      line = line[len("ENTRY "):]
    if line.startswith((name + " ", "%" + name + " ")):
      line = "ENTRY " + line
    out.append(line)
  return "\n".join(out)


def cost_analysis(hlo_text: str) -> dict:
  """XLA's cost analysis ("flops", "bytes accessed", ...) of a module's text, on the CPU
  client: it reads the instructions, not the backend, so it takes any target's text. Custom
  calls (cuBLAS, cuDNN, Pallas kernels) get no cost from it."""
  import jax
  from jax._src.lib import xla_client
  try:
    from jaxlib._hlo import hlo_module_from_text  # noqa: PLC0415 (newer jaxlibs)
  except ImportError:
    hlo_module_from_text = getattr(xla_client._xla, "hlo_module_from_text", None)
  analyse = getattr(xla_client._xla, "hlo_module_cost_analysis", None)
  if hlo_module_from_text is None or analyse is None:
    raise RuntimeError(f"this jaxlib ({jax.lib.__version__}) exposes no HLO parser or cost "
                       "analysis")
  return analyse(jax.devices("cpu")[0].client, hlo_module_from_text(parsable(hlo_text)))


# XLA:GPU prints the buffers an async collective's start aliases (`all-reduce-start` on a mesh),
# which its own parser takes on custom calls alone; they do not change a cost
_ALIASING = re.compile(r", output_to_operand_aliasing=\{(?:[^{}]|\{[^{}]*\})*\}")


def parsable(hlo_text: str) -> str:
  """A module's text as XLA's parser takes it: the aliasing of instructions other than custom
  calls left out."""
  return "\n".join(line if "custom-call(" in line else _ALIASING.sub("", line)
                   for line in hlo_text.splitlines())
