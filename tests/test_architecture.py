"""The package's shape: no import circles anywhere in `paraflax/` (imports anywhere in a file,
module level or inside functions; a package `__init__` re-exporting its own children does not
count), and no file under `decoding/` or `training/` of 400 lines or more.

`python tests/test_architecture.py` prints every circle of the whole package."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "paraflax"


def _module(path: Path, root: Path) -> str:
  parts = path.relative_to(root.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _call_time(tree: ast.AST) -> set[int]:
  """ids of the import statements inside functions (run at call time, not on import)."""
  return {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
          for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}


def import_graph(root: Path = ROOT, *, module_level: bool = False) -> dict[str, set[str]]:
  """{module: the paraflax modules it imports}, every import statement in the file counted
  (`module_level`: only those outside functions)."""
  files = {_module(p, root): p for p in sorted(root.rglob("*.py"))}
  graph = {}
  for name, path in files.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _call_time(tree) if module_level else set()
    for node in ast.walk(tree):
      if id(node) in skip:
        continue
      if isinstance(node, ast.Import):
        for alias in node.names:
          parts = alias.name.split(".")
          known = [".".join(parts[:i]) for i in range(len(parts), 0, -1)
                   if ".".join(parts[:i]) in files]
          targets.update(known[:1])
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
          child = f"{base}.{alias.name}"
          if child in files:
            targets.add(child)
          elif base in files:
            targets.add(base)
    if path.name == "__init__.py":  # re-exports of its own children do not count
      targets = {t for t in targets if not t.startswith(name + ".")}
    graph[name] = targets - {name}
  return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module, each sorted (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


@pytest.mark.fast
def test_the_graph_sees_imports_inside_functions_and_skips_init_reexports():
  graph = import_graph()
  assert "paraflax.training.store" in graph["paraflax.training.teacher"]  # `from pkg import mod`
  assert "paraflax.training.config" not in graph["paraflax.training"]
  assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.fast
def test_no_import_circles_in_paraflax():
  graph = import_graph()
  assert len(graph) > 50 and graph["paraflax.decoding.generate"]  # the whole package was read
  found = circles(graph)
  assert found == [], found


# docs/architecture.md's floors (foundation modules: 0); a module imports its floor or below
FLOORS = {"paraflax.data": 1, "paraflax.decoding": 2, "paraflax.decoders": 2,
          "paraflax.methods": 2, "paraflax.training": 3, "paraflax.hf": 4, "paraflax.loading": 5,
          "paraflax.training.from_hf": 5, "paraflax.evaluation": 6, "paraflax.perf": 6, "paraflax.cli": 7,
          "paraflax": 8}
# the imports inside functions that go up, each reading a Hugging Face directory (the doc
# names them): nothing else may
CALL_TIME_UP = {("paraflax.data.tokenizer_roles", "paraflax.data.chat"),
                ("paraflax.data.text", "paraflax.data.chat"),
                ("paraflax.training.workdir", "paraflax.hf"),
                ("paraflax.training.collect", "paraflax.hf"),
                ("paraflax.training.collect", "paraflax.data.chat"),
                ("paraflax.training.__main__", "paraflax.training.from_hf")}


def floor_of(module: str) -> int:
  if module == "paraflax":
    return FLOORS["paraflax"]
  hits = [p for p in FLOORS if p != "paraflax" and (module == p or module.startswith(p + "."))]
  return FLOORS[max(hits, key=len)] if hits else 0


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
  return {(a, b) for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a)}


@pytest.mark.fast
def test_imports_go_down_the_floors_but_the_named_call_time_ones():
  assert floor_of("paraflax.model.masks") == 0 and floor_of("paraflax.data.chat") == 4
  assert upward({"paraflax.model.masks": {"paraflax.cli"}}) == {("paraflax.model.masks", "paraflax.cli")}
  assert upward(import_graph(module_level=True)) == set()
  assert upward(import_graph()) == CALL_TIME_UP


@pytest.mark.fast
@pytest.mark.parametrize("floor", ["decoding", "training"])
def test_files_in_the_growing_floors_stay_small(floor):
  sizes = {p.name: len(p.read_text().splitlines()) for p in sorted((ROOT / floor).glob("*.py"))}
  assert len(sizes) > 5
  long = {name: n for name, n in sizes.items() if n >= 400}
  assert long == {}, long


if __name__ == "__main__":
  for c in circles(import_graph()):
    print(len(c), " ".join(c))
