"""Imports run one way (cli → commands → library → model): no cycle in `dspark_hf`, and nothing imports the CLI;
and functions stay small (library 60 lines, remote code 40, exceptions named in `LONGER_ALLOWED`).

Read from the source with `ast` (function-local imports included), so the test sees every edge without importing.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dspark_hf"
ROOT = PACKAGE.parent


def remote_code_files() -> tuple[str, ...]:
    """`REMOTE_CODE_FILES` as written in configuration_dspark.py (the one list of them)."""
    tree = ast.parse((ROOT / "configuration_dspark.py").read_text())
    assignment = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "REMOTE_CODE_FILES")
    return ast.literal_eval(assignment.value)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every module of the package, the remote-code files at the root included (served as `dspark_hf.remote_code`)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules.update({f"dspark_hf.remote_code.{name[:-3]}": ROOT / name for name in remote_code_files()})
    return modules


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the dspark_hf modules it imports anywhere in its body."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, is_package, node.level, node.module) if node.level else node.module
                submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]
                targets = submodules if len(submodules) == len(node.names) else [source, *submodules]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert graph["dspark_hf.evaluation"] and graph["dspark_hf.calibration"]  # the parser sees edges at all
    assert "dspark_hf.remote_code.generation_dspark" in graph["dspark_hf.remote_code.drafting_dspark"]  # and siblings
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# The remote code's layers, lowest first: each file imports only from its own layer or the ones below.
REMOTE_CODE_LAYERS = (
    ("configuration_dspark", "heads_dspark", "context_cache_dspark", "modeling_dspark"),  # the model
    ("token_choice_dspark", "scheduling_dspark", "profiling_dspark", "live_profiling_dspark", "settings_dspark"),  # engine
    ("generation_dspark", "batching_dspark", "batch_rows_dspark", "packing_dspark", "routing_dspark"),  # the drivers
    ("drafting_dspark",),  # the class users load
)


def test_remote_code_imports_run_driver_to_engine_to_model():
    graph = import_graph()
    layer_of = {f"dspark_hf.remote_code.{name}": i for i, names in enumerate(REMOTE_CODE_LAYERS) for name in names}
    assert set(layer_of) == {f"dspark_hf.remote_code.{name[:-3]}" for name in remote_code_files()}
    upward = sorted(f"{source} -> {target}" for source in layer_of for target in graph[source]
                    if target in layer_of and layer_of[target] > layer_of[source])
    assert upward == [], "a lower layer imports a higher one"


def test_no_module_imports_the_cli():
    importers = sorted(name for name, targets in import_graph().items() if "dspark_hf.cli" in targets)
    assert importers == []


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# ----------------------------------------------------------------------------------------------------------------
# Small functions (issue 11): a function does one stage. Counted as def..end lines with `ast`, decorators excluded.

REMOTE_CODE = remote_code_files()
LIBRARY_LIMIT, REMOTE_CODE_LIMIT = 60, 40

# "path::qualified name" -> why it is longer. Every entry must also say so in the function's docstring.
LONGER_ALLOWED: dict[str, str] = {}


def function_lengths(path: Path) -> dict[str, int]:
    """Qualified name (`Class.method`, `outer.inner`) -> lines from `def` to the function's last line."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[name] = child.end_lineno - child.lineno + 1
            visit(child, f"{name}." if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else prefix)

    visit(ast.parse(path.read_text()), "")
    return lengths


def _sized_files() -> list[tuple[Path, int]]:
    return [(ROOT / name, REMOTE_CODE_LIMIT) for name in REMOTE_CODE] + [
        (path, LIBRARY_LIMIT) for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _too_long() -> dict[str, int]:
    too_long = {}
    for path, limit in _sized_files():
        for name, length in function_lengths(path).items():
            if length > limit:
                too_long[f"{path.relative_to(ROOT).as_posix()}::{name}"] = length
    return too_long


def test_no_function_is_longer_than_its_limit():
    """Library functions stay within 60 lines, remote-code functions within 40, apart from `LONGER_ALLOWED`."""
    unexpected = {name: length for name, length in _too_long().items() if name not in LONGER_ALLOWED}
    assert unexpected == {}, f"split these (library {LIBRARY_LIMIT}, remote code {REMOTE_CODE_LIMIT} lines): {unexpected}"


def test_every_allowed_exception_is_still_long_and_documented():
    too_long = _too_long()
    for name in LONGER_ALLOWED:
        assert name in too_long, f"{name} is within its limit now; remove it from LONGER_ALLOWED"
        path, qualified = name.split("::")
        node = next(
            n for n in ast.walk(ast.parse((ROOT / path).read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == qualified.split(".")[-1]
        )
        assert "longer" in (ast.get_docstring(node) or "").lower(), f"{name}: say in its docstring why it is longer"


def test_function_lengths_count_def_to_end(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("class A:\n    def f(self):\n        def g():\n            return 1\n        return g\n\n\ndef h():\n    pass\n")
    assert function_lengths(source) == {"A.f": 4, "A.f.g": 2, "h": 2}


# ----------------------------------------------------------------------------------------------------------------
# Remote code split by concern (issue 25): the model file is the model; each other concern has a file of its own.

MODEL_FILE_LIMIT, SIBLING_FILE_LIMIT = 800, 500
REMOTE_CODE_TOTAL_LIMIT = 3630  # issue 34 held it under 3,586; issue 56 added the packing probe (24 lines),
# issue 57 the Markov table over the draft vocabulary (21)
NOT_THE_MODEL = ("perf_counter", "cpuinfo", "hashlib", "json.dump", "setattr(GenerationMixin")


def test_remote_code_files_stay_small_and_the_model_file_holds_only_the_model():
    for name in REMOTE_CODE:
        lines = len((ROOT / name).read_text().splitlines())
        limit = MODEL_FILE_LIMIT if name == "modeling_dspark.py" else SIBLING_FILE_LIMIT
        assert lines <= limit, f"{name} has {lines} lines (limit {limit}): move a concern into a file of its own"
    total = sum(len((ROOT / name).read_text().splitlines()) for name in REMOTE_CODE)
    assert total <= REMOTE_CODE_TOTAL_LIMIT, f"the remote code has {total} lines (limit {REMOTE_CODE_TOTAL_LIMIT})"
    model = (ROOT / "modeling_dspark.py").read_text()
    assert [word for word in NOT_THE_MODEL if word in model] == [], "timing, probing and storage belong elsewhere"


def _schedule_class_checks(path: Path) -> list[str]:
    """`isinstance(x, <...Schedule...>)` calls in a file: code that branches on a schedule's class."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            if "Schedule" in ast.unparse(node.args[1]):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_the_schedule_module_looks_at_schedule_classes():
    """The candidate generator talks to every schedule through one interface (hooks that are no-ops on the simple
    schedules), never by testing which schedule it has."""
    checks = [hit for name in REMOTE_CODE if name != "scheduling_dspark.py" for hit in _schedule_class_checks(ROOT / name)]
    assert checks == []


def test_schedule_class_check_finder_finds_one(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("if isinstance(schedule, DSparkHardwareAwareSchedule):\n    pass\n")
    assert _schedule_class_checks(source) == ["m.py:1"]


def test_each_drafting_knob_is_read_in_one_function():
    """`dspark_*` knobs and `num_assistant_tokens` are read from a generation_config only by
    `DSparkDraftingSettings.from_drafter` (string constants elsewhere are messages or comments, not reads)."""
    readers = set()
    for name in REMOTE_CODE:
        tree = ast.parse((ROOT / name).read_text())
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(function):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value == "num_assistant_tokens" or node.value.startswith("dspark_")
                ) and not any(node in ast.walk(call) for call in ast.walk(function) if isinstance(call, ast.JoinedStr)):
                    readers.add(f"{name}::{function.name}")
    assert readers == {"settings_dspark.py::from_drafter"}
