"""The package's shape: no import circles anywhere in `paraflax/` (imports anywhere in a file,
module level or inside functions; a package `__init__` re-exporting its own children does not
count), no import that goes up a floor or closes a loop between folders, no module that only
re-exports another (no shims), and no file under `decoding/` or `training/` of 400 lines or
more.

`python tests/test_architecture.py` prints every circle (of modules, of folders) and every
import going up a floor; `--write` rewrites docs/architecture.md's imports column from the code
(the page's floors and module rows are checked here)."""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "paraflax"


def _module(path: Path, root: Path) -> str:
  parts = path.relative_to(root.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
  """{module: the paraflax modules it imports}, every import statement in the file counted
  (module level and inside functions)."""
  files = {_module(p, root): p for p in sorted(root.rglob("*.py"))}
  graph = {}
  for name, path in files.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
  # `from pkg import mod`
  assert "paraflax.training.stores.store" in graph["paraflax.training.stores.teacher"]
  assert "paraflax.training.config.train" not in graph["paraflax.training"]
  assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.fast
def test_no_import_circles_in_paraflax():
  graph = import_graph()
  assert len(graph) > 50 and graph["paraflax.decoding.generate"]  # the whole package was read
  found = circles(graph)
  assert found == [], found


# docs/architecture.md's floors (loose foundation modules: 0); a module imports its floor or
# below, at module level and inside functions alike (a lazy import points down too)
FLOORS = {"paraflax.parallel": 0, "paraflax.model": 1, "paraflax.data": 2,
          "paraflax.decoding": 3, "paraflax.decoders": 3, "paraflax.methods": 3, "paraflax.hf": 3,
          "paraflax.training": 4, "paraflax.loading": 5, "paraflax.recipes": 5,
          "paraflax.evaluation": 6, "paraflax.perf": 7, "paraflax.apps": 8, "paraflax.cli": 9,
          "paraflax": 10}


def floor_of(module: str) -> int:
  if module == "paraflax":
    return FLOORS["paraflax"]
  hits = [p for p in FLOORS if p != "paraflax" and (module == p or module.startswith(p + "."))]
  return FLOORS[max(hits, key=len)] if hits else 0


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
  return {(a, b) for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a)}


def folder_of(module: str) -> str:
  """The folder a module lives in (`paraflax.training.run.step` -> `paraflax.training`); a loose
  module is a folder of its own."""
  parts = module.split(".")
  return ".".join(parts[:2]) if (ROOT.parent / Path(*parts[:2])).is_dir() else module


def folders(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """The import graph between folders (imports inside a folder dropped)."""
  out = {}
  for a, targets in graph.items():
    out.setdefault(folder_of(a), set()).update(folder_of(b) for b in targets)
  return {f: targets - {f} for f, targets in out.items()}


@pytest.mark.fast
def test_no_import_goes_up_a_floor_at_module_level_or_inside_a_function():
  assert floor_of("paraflax.model.masks") == 1 and floor_of("paraflax.hf.load") == 3
  assert floor_of("paraflax.json_io") == 0 and floor_of("paraflax.recipes.hf.sft") == 5
  assert upward({"paraflax.model.masks": {"paraflax.cli"}}) == {("paraflax.model.masks",
                                                                 "paraflax.cli")}
  graph = import_graph()
  assert "paraflax.hf" in graph["paraflax.training.workdirs.workdir"]  # an import inside a function
  assert upward(graph) == set()


@pytest.mark.fast
def test_no_loop_between_folders():
  assert folder_of("paraflax.training.run.step") == "paraflax.training"
  assert folder_of("paraflax.recipes.hf.sft") == "paraflax.recipes"
  assert folder_of("paraflax.json_io") == "paraflax.json_io"
  graph = folders(import_graph())
  assert {"paraflax.model", "paraflax.parallel", "paraflax.apps"} <= set(graph)
  assert "paraflax.parallel" in graph["paraflax.model"]
  assert circles(graph) == []


# modules that are namespaces by contract: `pf.decoders.<Name>` (DESIGN section 6)
NAMESPACES = {"paraflax.decoders"}


def reexports_only(path: Path) -> bool:
  """True for a module (not a package `__init__`) whose body is only imports, a docstring,
  `__all__` and warnings: a module that only re-exports others."""
  body = ast.parse(path.read_text(), str(path)).body
  def passive(node):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      return True
    if isinstance(node, ast.Expr):  # a docstring or a bare call such as warnings.warn(...)
      return isinstance(node.value, (ast.Constant, ast.Call))
    return (isinstance(node, ast.Assign)
            and [getattr(t, "id", "") for t in node.targets] == ["__all__"])
  return path.name != "__init__.py" and bool(body) and all(map(passive, body))


@pytest.mark.fast
def test_no_module_only_reexports_another_and_no_package_looks_names_up_lazily(tmp_path):
  shim = tmp_path / "old.py"
  shim.write_text('"""Moved."""\nimport warnings\nfrom a.b import *\nwarnings.warn("moved")\n')
  assert reexports_only(shim) and not reexports_only(ROOT / "sampling.py")
  files = {_module(p, ROOT): p for p in sorted(ROOT.rglob("*.py"))}
  found = {m for m, p in files.items() if reexports_only(p)} - NAMESPACES
  assert found == set(), found
  lazy = {m for m, p in files.items()
          if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                 for n in ast.parse(p.read_text()).body)}
  assert lazy == set(), lazy


@pytest.mark.fast
@pytest.mark.parametrize("floor", ["decoding", "training"])
def test_files_in_the_growing_floors_stay_small(floor):
  sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
           for p in sorted((ROOT / floor).rglob("*.py"))}
  assert len(sizes) > 5
  long = {name: n for name, n in sizes.items() if n >= 400}
  assert long == {}, long


def lines(folder: Path) -> int:
  return sum(len(p.read_text().splitlines()) for p in folder.rglob("*.py"))


@pytest.mark.fast
def test_training_is_rooms_of_at_most_12_modules_none_over_15_percent_of_the_library():
  rooms = [d for d in sorted((ROOT / "training").rglob("*")) if d.is_dir()
           and d.name != "__pycache__"]
  assert len(rooms) >= 4
  crowded = {d.name: n for d in [ROOT / "training", *rooms]
             if (n := len([*d.glob("*.py")])) > 12}
  assert crowded == {}, crowded
  total = lines(ROOT)
  heavy = {d.name: f"{share:.0%}" for d in rooms if (share := lines(d) / total) > 0.15}
  assert heavy == {}, heavy


# docs/architecture.md: its floor diagram is FLOORS, and its module tables list every module
# (package `__init__`s and recipes aside) with the imports the code has
PAGE = ROOT.parent / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(?P<path>[\w/]+\.py)` \| (?P<owns>.*) \| (?P<imports>.*) \|$")


def page_modules(graph: dict[str, set[str]]) -> list[str]:
  """The modules the page's tables must list: all but `__init__`s and the recipes."""
  return sorted(m for m in graph if not m.startswith("paraflax.recipes")
                and not (ROOT.parent / Path(*m.split("."))).is_dir())


def path_of(module: str) -> str:
  return "/".join(module.split(".")[1:]) + ".py"


def imports_cell(module: str, graph: dict[str, set[str]]) -> str:
  """What the page's imports column says for `module`: each paraflax module it imports, named
  inside its own folder when they share one (`run.step`), else from `paraflax` (`model.masks`)."""
  folder = folder_of(module)
  def short(target):
    inside = folder != module and target.startswith(folder + ".")
    return target[len(folder) + 1:] if inside else target.removeprefix("paraflax.")
  return ", ".join(f"`{short(t)}`" for t in sorted(graph[module])) or "none"


def page_rows() -> dict[str, re.Match]:
  return {m["path"]: m for line in PAGE.read_text().splitlines() if (m := ROW.match(line))}


def page_floors() -> dict[str, int]:
  """{module: floor} of the page's diagram (`  4   training/   ...`; a line without a number
  continues the one above)."""
  diagram = PAGE.read_text().split("```\n", 2)[1]
  out, floor = {}, None
  for line in diagram.splitlines():
    head = re.match(r"^ *(top|\d+)? +(\S.*?)(?: {2,}|$)", line)
    if head:
      floor = head[1] or floor
      for name in re.findall(r"[\w]+/|[\w]+\.py", head[2]):
        stem = name.removesuffix("/").removesuffix(".py")
        module = "paraflax" if stem == "__init__" else f"paraflax.{stem}"
        out[module] = FLOORS["paraflax"] if floor == "top" else int(floor)
  return out


@pytest.mark.fast
def test_the_architecture_pages_floors_are_the_tests():
  assert page_floors() == FLOORS


@pytest.mark.fast
def test_the_architecture_page_lists_every_module_with_the_imports_it_has():
  graph = import_graph()
  assert imports_cell("paraflax.training.run.trainer", graph).count("`workdirs.") >= 2
  assert "`model.masks`" in imports_cell("paraflax.decoding.autoregressive", graph)
  rows = page_rows()
  want = {path_of(m) for m in page_modules(graph)}
  assert sorted(want - rows.keys()) == [] and sorted(rows.keys() - want) == [], \
      "docs/architecture.md: add or remove rows (python tests/test_architecture.py --write)"
  stale = {path: rows[path]["imports"] for path in want
           if rows[path]["imports"] != imports_cell(
               "paraflax." + path[:-3].replace("/", "."), graph)}
  assert stale == {}, "run `python tests/test_architecture.py --write`"


def write_page() -> None:
  """Rewrite the imports column of docs/architecture.md from the code; print the modules that
  have no row yet (add one by hand, with what the module owns) and rows of modules gone."""
  graph = import_graph()
  cells = {path_of(m): imports_cell(m, graph) for m in page_modules(graph)}
  lines = PAGE.read_text().splitlines()
  for i, line in enumerate(lines):
    if (m := ROW.match(line)) and m["path"] in cells:
      lines[i] = f"| `{m['path']}` | {m['owns']} | {cells[m['path']]} |"
  PAGE.write_text("\n".join(lines) + "\n")
  rows = page_rows()
  for path in sorted(cells.keys() - rows.keys()):
    print(f"no row: | `{path}` | ... | {cells[path]} |")
  for path in sorted(rows.keys() - cells.keys()):
    print(f"no such module: {path}")


if __name__ == "__main__":
  if sys.argv[1:] == ["--write"]:
    write_page()
    sys.exit()
  graph = import_graph()
  for c in circles(graph) + circles(folders(graph)):
    print(len(c), " ".join(c))
  for a, b in sorted(upward(graph)):
    print("up a floor:", a, "->", b)
