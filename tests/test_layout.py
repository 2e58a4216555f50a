"""The repository's layout rules, read from the source (no imports run): the project's modules
import each other without a cycle, the leaf modules import nothing of the project, benchmarks
and tests do not import each other, and the README's module map names every root module."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem for p in ROOT.glob("*.py")}
LEAVES = ("config", "failures", "host_memory", "parallel_dims")  # import nothing of the project


def imports(path: Path) -> set[str]:
    """Root modules (and `bench`, `tests` helpers) that `path` imports, at any depth of the file
    (lazy imports inside functions count: a cycle through them still ties two concepts), except
    imports only for type checking (`if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
    bench = {p.stem for p in (ROOT / "bench").glob("*.py")}
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
