"""The shape of the code, read with ast: no import circles, search/ layered cli -> pick, ui -> study -> tracking/stores,
trainers/ free of search, optuna and mlflow, no module over MAX_LINES lines and no function over MAX_FUNCTION_LINES."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("search", "trainers")  # folders of the checkout, importable as latentsweep.<folder>
MAX_LINES = 400
# A function a reader holds in one screen (issue 41): longer ones are split along a seam.
MAX_FUNCTION_LINES = 80
# A package may import only packages on its own level or below (never one above): cli -> pick -> study -> the bottom.
LAYERS = {"api": 3, "cli": 3, "pick": 2, "ui": 2, "study": 1, "failures": 0, "tracking": 0, "stores": 0, "process": 0,
          "redact": 0, "demodata": 3, "progress": 0, "checks": 0}
# the API, `python -m latentsweep` and the package
ENTRY = {"latentsweep", "latentsweep.__main__", "latentsweep.search"}
# itself sit above every layer
TRAINERS_NEVER = ("latentsweep.search", "latentsweep", "optuna", "mlflow")
# All MLflow access goes through the tracker (and its probe, which asks MLflow's own HTTP client); the standalone pyfunc
# module is shipped into the model and loads there.
MLFLOW_MODULES = {"latentsweep.search.tracking.mlflow", "latentsweep.search.tracking.probe",
                  "latentsweep.search.tracking.schema", "latentsweep.search.pick.pyfunc_standalone"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == "latentsweep" else ("latentsweep", *parts))


MODULES = {module_name(p): p for pkg in (*PACKAGES, "latentsweep") for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_names(name: str) -> set[str]:
    """Every dotted name a module imports, at the top or inside functions: `import a.b` gives a.b; `from a import b`
    gives a and a.b (b may be a submodule); relative imports are resolved against the module's package."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def internal_imports(name: str) -> set[str]:
    """The modules of search/ and trainers/ that `name` imports."""
    return {n for n in imported_names(name) if n in MODULES and n != name}


GRAPH = {name: internal_imports(name) for name in MODULES}


def layer(name: str) -> int | None:
    parts = name.split(".")
    if name in ENTRY:
        return None
    if parts[1] == "trainers":
        return -1
    return LAYERS[parts[2]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_search_module_has_a_layer():
    assert all(layer(name) is not None or name in ENTRY for name in MODULES)


def test_no_import_cycles_in_search():
    assert [c for c in cycles(GRAPH) if c[0].startswith("latentsweep.search")] == []


def test_no_import_cycles_in_trainers():
    assert [c for c in cycles(GRAPH) if c[0].startswith("latentsweep.trainers")] == []


def test_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lower_packages_never_import_higher_ones():
    upward = [f"{src} -> {dst}" for src, targets in GRAPH.items() for dst in sorted(targets)
              if layer(src) is not None and layer(dst) is not None and layer(dst) > layer(src)]
    assert upward == []


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith("latentsweep.trainers")])
def test_trainers_never_import_search_optuna_or_mlflow(name):
    bad = sorted(n for n in imported_names(name)
                 if n.split(".")[0] in TRAINERS_NEVER[2:] or n == "latentsweep" or n.startswith(TRAINERS_NEVER[0]))
    assert bad == []


def test_only_the_mlflow_tracker_imports_mlflow():
    users = sorted(name for name in MODULES if name not in MLFLOW_MODULES
                   and any(n.split(".")[0] == "mlflow" for n in imported_names(name)))
    assert users == []


@pytest.mark.parametrize("name", list(MODULES))
def test_modules_are_short(name):  # every module of trainers/ and search/
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)}: {lines} lines"


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'name (N lines)' of every function or method of `source` longer than `limit` lines, its decorators aside."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit]


def test_functions_are_short():  # every function and method of trainers/ and search/
    found = {str(path.relative_to(ROOT)): long for path in MODULES.values()
             if (long := long_functions(path.read_text()))}
    assert not found, found


def test_the_length_check_sees_a_long_method():
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # with its def line: one too many
    assert long_functions(f"class A:\n    def f(self):\n{body}") == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(f"class A:\n    def f(self):\n{body[:body.rindex('        x')]}") == []  # at the limit


# cli/ only parses arguments, calls one function and prints: process handling (psutil, subprocess) and the checks a
# command makes live below it (search/ui, search/study/preflight), and a module that grows past this is doing more.
CLI_MAX_LINES = 150
CLI_NEVER = {"psutil", "subprocess"}


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith("latentsweep.search.cli.")])
def test_cli_modules_only_parse_call_and_print(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= CLI_MAX_LINES, f"{MODULES[name].relative_to(ROOT)}: {lines} lines"
    assert sorted(n for n in imported_names(name) if n.split(".")[0] in CLI_NEVER) == []


def leaf_commands(parser, path=()):
    """(command words, parser) of every runnable `latentsweep` command."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from leaf_commands(sub, (*path, name))


def test_every_command_handler_is_named_after_its_command():
    # The rule: `latentsweep study run` -> cmd_study_run, `latentsweep data build-demo` -> cmd_data_build_demo.
    from latentsweep.search.cli.main import build_parser

    names = {" ".join(path): parser.get_default("func").__name__ for path, parser in leaf_commands(build_parser())}
    assert {c: n for c, n in names.items() if n != "cmd_" + c.replace(" ", "_").replace("-", "_")} == {}
    assert len(names) >= 14


def test_each_command_builds_from_its_own_module_only():
    """MODULE_OF names the module that adds each top-level command, and a command's parser imports no other."""
    import argparse
    import importlib

    from latentsweep.search.cli.main import COMMAND_MODULES, MODULE_OF

    owner = {}
    for name in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"latentsweep.search.cli.{name}").add_parser(sub)
        owner.update({command: name for command in sub.choices})
    assert MODULE_OF == owner
    code = ("import sys; from latentsweep.search.cli.main import build_parser; build_parser('train'); "
            "print(sorted(m for m in ('mlflow', 'pandas', 'latentsweep.search.pick', 'latentsweep.search.cli.study') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_process_settings_do_not_import_matplotlib_and_figures_still_draw_headless():
    """configure_process sets the backend through MPLBACKEND when matplotlib is not loaded yet (`train` never loads
    it: 28 MB of RSS); the first figure drawn later still uses Agg, with no display."""
    code = ("import os, sys; os.environ.pop('MPLBACKEND', None); os.environ.pop('DISPLAY', None); "
            "from latentsweep.search.cli.main import build_parser; from latentsweep.search.process import configure_process; "
            "build_parser('train'); configure_process(); print('matplotlib' in sys.modules); "
            "import matplotlib.pyplot as plt; print(plt.get_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split() == ["False", "Agg"]


def test_light_parser_help_lines_match_the_commands_own_parsers():
    """`latentsweep --help` lists COMMAND_HELP without importing the command modules: the lines must be theirs."""
    import argparse

    from latentsweep.search.cli.main import COMMAND_HELP, build_parser

    def helps(parser):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {choice.dest: choice.help for choice in sub._choices_actions}

    assert helps(build_parser(light=True)) == helps(build_parser()) == COMMAND_HELP


@pytest.mark.parametrize("argv", [["--version"], ["--help"], [], ["no-such-command"]])
def test_version_and_help_import_no_heavy_library(argv):
    """--version, --help, no command and an unknown command answer from the light parser: neither torch nor Optuna
    nor MLflow nor SQLAlchemy is imported (each costs seconds at start-up; docs/design.md, "Start-up")."""
    code = ("import sys; from latentsweep.search.cli.main import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'optuna', 'mlflow', 'sqlalchemy', 'requests', 'pandas') "
            "if m in sys.modules), file=sys.stderr)")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stderr
    assert err.strip().splitlines()[-1] == "[]"


def test_the_failure_classification_imports_no_heavy_library_until_it_meets_one():
    """latentsweep.search.failures names library errors by module and looks them up in the libraries already imported:
    an error
    of a library's class exists only once that library is loaded. Classifying a plain error imports nothing more."""
    code = ("import sys; from latentsweep.search.failures import classify; classify(OSError(28, 'No space left on device')); "
            "print(sorted(m for m in ('torch', 'requests', 'sqlalchemy', 'optuna', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"
