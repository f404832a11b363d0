"""The layout keeps its promises: one import direction, no cycles, small modules."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# __main__ → cli → {plan, hf, generate, testing} → training → {observe, data} → models → parallel →
# sharding → {config, runtime, meshes} → bounds → errors. A module imports only lower ranks (or
# its own group).
RANKS = {
    "shardlab.__main__": 9,  # the `shardlab` command: restarts for huge pages, then cli
    "shardlab.cli": 8,
    "shardlab.plan": 7, "shardlab.hf": 7, "shardlab.generate": 7, "shardlab.testing": 7,
    "shardlab.training": 6,
    "shardlab.observe": 5, "shardlab.data": 5,
    "shardlab.models": 4,
    "shardlab.parallel": 3,
    "shardlab.sharding": 2,
    "shardlab.config": 1, "shardlab.runtime": 1, "shardlab.meshes": 1,
    "shardlab.bounds": 0.5,  # a number's declared range (ConfigError when out of it)
    "shardlab.remat": 0.5,  # the remat policies by name (the config lists them)
    "shardlab.errors": 0,
    "shardlab": 0,  # the package: a lazy table of names, importing nothing
}
# What a bundled architecture may import from shardlab: the public names only, as a user's
# own module would (the package's lazy table, the building blocks, the errors, Config).
PUBLIC = {"shardlab", "shardlab.parallel", "shardlab.errors", "shardlab.config"}
MAX_LINES, MAX_FUNCTION_LINES = 300, 60


def modules() -> dict[str, pathlib.Path]:
  found = {}
  for folder, package in (("shardlab", "shardlab"), ("models", "shardlab.models"),
                          ("meshes", "shardlab.meshes")):
    for path in (ROOT / folder).rglob("*.py"):
      parts = path.relative_to(ROOT / folder).with_suffix("").parts
      name = ".".join((package, *parts)).removesuffix(".__init__")
      found[name] = path
  return found


def group(name: str) -> str:
  return max((g for g in RANKS if name == g or name.startswith(g + ".")), key=len)


def imports(name: str, path: pathlib.Path, known) -> set[str]:
  """Every shardlab module `path` imports, at any depth of its code."""
  out = set()
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base])
      # `from package import submodule` runs the package's __init__ first: it depends on
      # both (a package that imports its submodules then closes a cycle).
      targets = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    for target in targets:
      while target and target not in known:
        target = target.rpartition(".")[0]
      if target and target != name:
        out.add(target)
  return out


def graph() -> dict[str, set[str]]:
  known = modules()
  return {name: imports(name, path, known) for name, path in known.items()}


def test_imports_follow_the_stated_direction():
  edges = graph()
  assert "shardlab.sharding.rules" in edges["shardlab.training.state"]  # the parser sees imports
  wrong = []
  for name, targets in edges.items():
    for target in targets:
      if target == "shardlab" and name != "shardlab":
        continue  # `from shardlab import config` names the package only as a path
      mine, theirs = group(name), group(target)
      if mine != theirs and RANKS[theirs] >= RANKS[mine]:
        wrong.append(f"{name} ({mine}, rank {RANKS[mine]}) imports {target} "
                     f"({theirs}, rank {RANKS[theirs]})")
  assert not wrong, "\n".join(sorted(wrong))


def stated_chain() -> str:
  """RANKS as one sentence: 'cli → {plan, hf, generate, testing} → … → errors'."""
  by_rank: dict[int, list[str]] = {}
  for group_name, rank in RANKS.items():
    if group_name != "shardlab":
      by_rank.setdefault(rank, []).append(group_name.removeprefix("shardlab."))
  names = [g[0] if len(g) == 1 else "{" + ", ".join(g) + "}"
           for _, g in sorted(by_rank.items(), reverse=True)]
  return " → ".join(names)


def test_the_readme_states_the_enforced_chain_and_no_ghost_package():
  readme = " ".join((ROOT / "README.md").read_text().split())
  assert f"Imports go one way: {stated_chain()} " in readme
  known = modules()
  ghosts = [g for g in RANKS if g not in known]
  assert not ghosts, f"RANKS names packages that do not exist: {ghosts}"
  unranked = [name for name in known if not any(name == g or name.startswith(g + ".")
                                                for g in RANKS if g != "shardlab")
              and name != "shardlab"]
  assert not unranked, f"modules in no ranked group: {unranked}"


def test_no_import_cycles():
  edges = graph()
  cycles, done = [], set()

  def visit(node, path):
    if node in path:
      cycles.append(" -> ".join(path[path.index(node):] + [node]))
      return
    if node in done:
      return
    for target in sorted(edges.get(node, ())):
      if target != "shardlab":
        visit(target, path + [node])
    done.add(node)

  for node in sorted(edges):
    visit(node, [])
  assert not cycles, "\n".join(cycles)


def test_the_bundled_models_install_under_shardlab_and_the_core_names_none():
  assert "shardlab.models.llama" in modules() and "shardlab.models.gpt2" in modules()
  concrete = {"shardlab.models.llama", "shardlab.models.llama_config", "shardlab.models.gpt2",
              "shardlab.models.gpt2_config", "shardlab.models.registry"}
  core = ("shardlab.sharding", "shardlab.training", "shardlab.observe", "shardlab.runtime")
  wrong = [f"{name} imports {target}" for name, targets in graph().items()
           if name.startswith(core) for target in targets if target in concrete]
  assert not wrong, wrong


def test_modules_and_functions_are_small():
  too_long = []
  for name, path in modules().items():
    text = path.read_text()
    if len(text.splitlines()) > MAX_LINES:
      too_long.append(f"{name}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
          too_long.append(f"{name}.{node.name}: {length} lines")
  assert not too_long, "\n".join(too_long)


def public_names(module: str) -> set[str]:
  if module == "shardlab.parallel":
    import shardlab.parallel
    return set(shardlab.parallel.__all__)
  if module == "shardlab":
    import shardlab
    return set(shardlab.__all__) | {"parallel", "errors", "config"}
  return {"*"}


def private_imports(path: pathlib.Path) -> list[str]:
  """`import`s of `path` that reach past shardlab's public names (sibling models aside)."""
  wrong = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      wrong += [a.name for a in node.names if a.name.startswith("shardlab")
                and a.name not in PUBLIC and not a.name.startswith("shardlab.models")]
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardlab"):
      if node.module.startswith("shardlab.models"):
        continue
      if node.module not in PUBLIC:
        wrong.append(node.module)
        continue
      allowed = public_names(node.module)
      wrong += [f"{node.module}.{a.name}" for a in node.names
                if "*" not in allowed and a.name not in allowed]
  return wrong


def test_bundled_models_import_only_public_names():
  found = {name: path for name, path in modules().items()
           if name.startswith("shardlab.models.")}
  assert "shardlab.models.llama" in found
  wrong = {name: private_imports(path) for name, path in found.items()}
  wrong = {name: w for name, w in wrong.items() if w}
  assert not wrong, wrong
  # The check sees a private import when there is one.
  probe = ROOT / "tests" / "data" / "_private_import_probe.py"
  probe.write_text("from shardlab.parallel import flash\nfrom shardlab.sharding import rules\n")
  try:
    assert private_imports(probe) == ["shardlab.parallel.flash", "shardlab.sharding"]
  finally:
    probe.unlink()


def test_private_jax_imports_live_in_one_module():
  """Only shardlab/runtime/jax_compat.py reaches into jax._src (what a JAX upgrade checks)."""
  wrong = [name for name, path in modules().items()
           if "jax._src" in path.read_text() and name != "shardlab.runtime.jax_compat"]
  assert not wrong, wrong
