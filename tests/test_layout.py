"""The repository's layout rules, read from the source (no imports run): the project's modules
import each other without a cycle, the leaf modules import nothing of the project, benchmarks
and tests do not import each other, and the README's module map names every root module."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem for p in ROOT.glob("*.py")}
LEAVES = ("actor_slot", "config", "failures", "host_memory", "lifecycle")  # import nothing of the project


def imports(path: Path) -> set[str]:
    """Root modules (and `bench`, `tests` helpers) that `path` imports, at any depth of the file:
    lazy imports inside functions and imports for type checking only (`if TYPE_CHECKING:`)
    count too, since a cycle through them still ties two concepts together."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def graph() -> dict[str, set[str]]:
    return {m: imports(ROOT / f"{m}.py") & MODULES - {m} for m in MODULES}


def test_no_import_cycle():
    g, state, cycles = graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for n in sorted(g[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_leaf_modules_import_nothing_of_the_project():
    g = graph()
    assert {m: g[m] for m in LEAVES if g[m]} == {}


def test_benchmarks_and_tests_do_not_import_each_other():
    # A benchmark named as the root module it measures (bench/driver_failover.py) is imported as
    # `bench.NAME` only; a plain `import NAME` is the root module.
    bench = {p.stem for p in (ROOT / "bench").glob("*.py")} - MODULES
    test_helpers = {p.stem for p in (ROOT / "tests").glob("*.py")}
    for p in (ROOT / "tests").glob("*.py"):
        assert not imports(p) & (bench | {"bench"}), f"{p.name} imports a benchmark"
    for p in (ROOT / "bench").glob("*.py"):
        assert not imports(p) & (test_helpers | {"tests"}), f"bench/{p.name} imports a test helper"


def test_readme_module_map_names_every_root_module():
    readme = (ROOT / "README.md").read_text()
    named = {m for m in re.findall(r"`(\w+)\.py`", readme) if not m.startswith("test_")}
    assert MODULES - named == set(), f"root modules missing from the README's module map: {MODULES - named}"
    assert named - MODULES == set(), f"README names modules that do not exist: {named - MODULES}"


def test_both_engines_implement_the_engine_protocol():
    """Every method of `engine.Engine` exists on both engines with its parameters (further ones
    only if optional), and the actor reaches no engine attribute outside the protocol."""
    import inspect

    import engine
    import megatron_engine
    import torch_engine

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
