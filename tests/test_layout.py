"""The repository's layout rules, read from the source (no project import runs, except in the
engine-protocol test): the example's files at the top, the library `ftrain/` in folders by part;
imports run one way, down the layers `docs/architecture.md` lists (lazy imports and imports for
type checking only count too), with no cycle; the leaves import nothing of the project;
benchmarks and tests do not import each other; the README's table names every part."""
import ast
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ("main", "megatron_actor", "dispatch", "checkpoint")  # the example's modules, at the top
LEAVES = ("config", "failures", "testbeds")  # import nothing of the project


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every project module: the example's files at the top and every
    module of the `ftrain` package (a package's `__init__` under the package's own name)."""
    found = {name: root / f"{name}.py" for name in EXAMPLE}
    for path in (root / "ftrain").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known) -> set[str]:
    """The project modules `path` imports, at any depth of the file: lazy imports inside
    functions and imports for type checking only (`if TYPE_CHECKING:`) count too, since a
    cycle or an upward edge through them still ties two parts together. `from P import M`
    names module P.M where that is a module, else P."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                      for a in node.names}
    return {n for n in names if n in known}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    found = modules(root)
    return {m: imports(p, found) - {m} for m, p in found.items()}


def part(module: str) -> str:
    """The part a module belongs to: its folder under ftrain/ (`ftrain.control.health` ->
    control), a module at the package's root (`ftrain.config` -> config), or the example's file."""
    dotted = module.split(".")
    return dotted[0] if dotted[0] != "ftrain" else dotted[1] if len(dotted) > 1 else "ftrain"


def layers(root: Path = ROOT) -> dict[str, int]:
    """Part -> its layer, read from the block of docs/architecture.md after its `layers` marker:
    one line per layer, top first, the parts of a layer separated by spaces. A part may import
    its own modules and the parts of the layers below its own."""
    text = (root / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers[^>]*-->\s*```text\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no layers block"
    rows = [line.split() for line in block.group(1).strip().splitlines()]
    return {p: len(rows) - i for i, row in enumerate(rows) for p in row}


def violations(root: Path = ROOT) -> list[str]:
    """Every import against the direction of the layers, as 'importer -> imported (part a at
    layer i imports part b at layer j)'."""
    g, rank = graph(root), layers(root)
    out = []
    for m, targets in sorted(g.items()):
        for t in sorted(targets):
            a, b = part(m), part(t)
            if a != b and not rank[b] < rank[a]:
                out.append(f"{m} -> {t} ({a} at layer {rank[a]} imports {b} at layer {rank[b]})")
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    state, found = {}, []

    def visit(m, path):
        state[m] = "open"
        for n in sorted(g[m]):
            if state.get(n) == "open":
                found.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def test_the_project_uses_absolute_imports_only():
    """A relative import would hide an edge from these checks: `from ftrain.PART import MODULE`."""
    relative = [f"{m}:{n.lineno}" for m, p in modules(ROOT).items() for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.ImportFrom) and n.level]
    assert relative == []


def test_every_part_has_a_layer_and_every_layer_a_part():
    parts = {part(m) for m in modules(ROOT)} - {"ftrain"}
    rank = layers()
    assert parts - set(rank) == set(), f"parts missing from docs/architecture.md's layers: {parts - set(rank)}"
    assert set(rank) - parts == set(), f"docs/architecture.md lists parts that do not exist: {set(rank) - parts}"


def test_imports_run_down_the_layers():
    assert violations() == []


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_library_never_imports_the_example():
    g = graph()
    assert {m: g[m] & set(EXAMPLE) for m in g if m.startswith("ftrain") and g[m] & set(EXAMPLE)} == {}


def test_leaf_parts_import_nothing_of_the_project():
    g = graph()
    assert {m: g[m] for m in g if part(m) in LEAVES and g[m]} == {}


def test_an_import_against_the_direction_fails_the_check(tmp_path):
    """The check itself: a copy of the sources with one lazy import added against the direction
    (the state part reaching up into the trainer) and one cycle (two data modules importing each
    other) is refused with both named."""
    for name in EXAMPLE:
        shutil.copy(ROOT / f"{name}.py", tmp_path)
    shutil.copytree(ROOT / "ftrain", tmp_path / "ftrain", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "architecture.md", tmp_path / "docs")
    assert violations(tmp_path) == [] and cycles(graph(tmp_path)) == []
    with open(tmp_path / "ftrain" / "state" / "keeper.py", "a") as f:
        f.write("\n\ndef _late():\n    from ftrain.trainer import Trainer\n    return Trainer\n")
    with open(tmp_path / "ftrain" / "data" / "training_batch.py", "a") as f:
        f.write("\nif False:\n    from ftrain.data import rank_rows  # noqa\n")
    assert violations(tmp_path) == [
        "ftrain.state.keeper -> ftrain.trainer (state at layer 4 imports trainer at layer 8)"]
    assert ["ftrain.data.training_batch", "ftrain.data.rank_rows", "ftrain.data.training_batch"] in cycles(graph(tmp_path))


def test_benchmarks_and_tests_do_not_import_each_other():
    bench = {f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py")} | {"bench"}
    helpers = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests"}
    for p in (ROOT / "tests").rglob("*.py"):
        assert not imports(p, bench), f"{p.relative_to(ROOT)} imports a benchmark"
    for p in (ROOT / "bench").glob("*.py"):
        assert not imports(p, helpers), f"bench/{p.name} imports a test helper"


def test_no_module_at_the_top_but_the_example():
    """Nothing at the top of the repository can shadow an installed package of the same name
    (`config`, `data`, `metrics`, ...): the only modules there are the example's files."""
    assert {p.stem for p in ROOT.glob("*.py")} == set(EXAMPLE)


def test_readme_table_links_every_part():
    readme = (ROOT / "README.md").read_text()
    for p in layers():
        where = (f"ftrain/{p}/" if (ROOT / "ftrain" / p).is_dir() else f"ftrain/{p}.py" if (ROOT / "ftrain" / f"{p}.py").exists()
                 else f"{p}.py")
        assert f"]({where})" in readme, f"README's table of parts does not link {where}"


@pytest.mark.parametrize("package", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "ftrain").rglob("__init__.py")))
def test_each_package_says_what_it_owns(package):
    """Each folder's `__init__.py` is its docstring only (what the part owns, what it may call)."""
    tree = ast.parse((ROOT / package).read_text())
    assert ast.get_docstring(tree), f"{package} has no docstring"
    assert len(tree.body) == 1, f"{package} holds code: keep it in the part's modules"


def test_both_engines_implement_the_engine_protocol():
    """Every method of `engine.Engine` exists on both engines with its parameters (further ones
    only if optional), and the actor reaches no engine attribute outside the protocol."""
    import inspect

    from ftrain.engines import engine, megatron_engine, torch_engine

    methods = {n: inspect.signature(f) for n, f in vars(engine.Engine).items()
               if callable(f) and not n.startswith("_")}
    assert len(methods) >= 15, methods
    for cls in (torch_engine.TorchEngine, megatron_engine.MegatronEngine):
        for name, sig in methods.items():
            assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
            params = list(inspect.signature(getattr(cls, name)).parameters.values())
            extra = params[len(sig.parameters):]  # further parameters must be optional
            assert [p.name for p in params[:len(sig.parameters)]] == list(sig.parameters) and \
                all(p.default is not p.empty for p in extra), \
                f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} does not fit Engine.{name}{sig}"
    attributes = set(engine.Engine.__annotations__) | set(methods)
    used = set(re.findall(r"self\.engine\.(\w+)", (ROOT / "megatron_actor.py").read_text()))
    assert used <= attributes, f"the actor uses engine attributes outside the protocol: {used - attributes}"
