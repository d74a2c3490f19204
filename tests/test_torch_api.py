"""The torch APIs the code calls exist in the installed torch, and pyproject's torch floor is the newest they need."""
import ast
import importlib
import re
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainers", "search")

# Every torch API the code calls that is younger than torch 2.2, with the release that introduced it and where it is
# used. The floor in pyproject is the newest of them (only the pinned 2.13 CPU wheel is installed here, so an older
# torch cannot be installed to try: the floor is derived, and this table is what it is derived from).
NEWER_APIS = {
    "torch.export.Dim.DYNAMIC": ("2.6", "search/pick/pyfunc_model.py"),  # pytorch#137029, after the 2.5 branch cut
    "torch.OutOfMemoryError": ("2.5", "search/failures.py"),  # top level since 2.5 (was torch.cuda's)
    "torch.amp.GradScaler": ("2.3", "trainers/train/run.py"),  # device-generic scaler (torch.cuda.amp's before)
}
# Keyword features that an attribute check cannot see; each has a behaviour test below.
NEWER_FEATURES = {
    "Adam/AdamW(fused=True) on CPU": ("2.4", "trainers/train/optim.py"),
}


def torch_floor() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"torch\s*>=", d))
    return spec.split(">=")[1].strip()


def release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def resolve(dotted: str):
    """getattr along `dotted`, importing submodules (torch.optim.swa_utils) the way `import a.b` would."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part):
            try:
                importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                pass
        obj = getattr(obj, part)  # AttributeError: the installed torch lacks it
    return obj


def torch_names_in(path: Path) -> set[str]:
    """Every dotted torch name read in `path` (torch.x.y, nn.Linear via `from torch import nn`, F.normalize via
    `import torch.nn.functional as F`), longest chain of attributes only."""
    tree = ast.parse(path.read_text())
    alias = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = set(alias.values())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain, cur = [], node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in alias:
            names.add(".".join([alias[cur.id], *reversed(chain)]))
    return names | lazy_names(tree)


def lazy_names(tree: ast.AST) -> set[str]:
    """torch names read lazily, by a ("torch", ("Name", ...)) table (search/failures.py: classifying an error must
    not import torch): each is torch.Name."""
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Constant)
                and node.elts[0].value == "torch" and isinstance(node.elts[1], ast.Tuple)):
            names |= {f"torch.{e.value}" for e in node.elts[1].elts if isinstance(e, ast.Constant)}
    return names


def used_torch_names() -> dict[str, str]:
    """{dotted name: first file using it} over the package code."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in torch_names_in(path):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_torch_name_the_code_reads_exists_in_the_installed_torch():
    used = used_torch_names()
    assert len(used) > 50, "the scan found too few torch names: it no longer sees the code's imports"
    missing = []
    for name, where in sorted(used.items()):
        try:
            resolve(name)
        except AttributeError:
            missing.append(f"{name} ({where})")
    assert not missing, f"not in torch {torch.__version__}: {missing}"


@pytest.mark.parametrize("name", sorted(NEWER_APIS))
def test_each_newer_api_is_still_used_where_the_table_says(name):
    where = NEWER_APIS[name][1]
    assert name in torch_names_in(ROOT / where), f"{name} is no longer read in {where}: update NEWER_APIS"
    resolve(name)


def test_pyproject_torch_floor_is_the_newest_api_the_code_needs():
    needed = max((v for v, _ in [*NEWER_APIS.values(), *NEWER_FEATURES.values()]), key=release)
    assert release(torch_floor()) == release(needed)
    assert release(torch.__version__) >= release(torch_floor())


def test_fused_adam_steps_on_cpu():
    """trainers/train/optim.py passes fused=True for CPU float params (CPU fused kernels: torch 2.4)."""
    from latentsweep.trainers.train.optim import _fused

    w = torch.nn.Parameter(torch.ones(3))
    groups = [{"params": [w]}]
    assert _fused(groups)
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        opt = cls(groups, lr=0.1, fused=True)
        w.grad = torch.ones(3)
        opt.step()
    assert torch.all(w < 1)


def test_export_with_a_dynamic_batch_dim_takes_any_batch_size(tmp_path):
    """search/pick/pyfunc_model.py exports with Dim.DYNAMIC on the batch axis and reloads with torch.export.load."""
    model = torch.nn.Linear(4, 2)
    program = torch.export.export(model, (torch.zeros(8, 4),), dynamic_shapes={"input": {0: torch.export.Dim.DYNAMIC}})
    torch.export.save(program, str(tmp_path / "m.pt2"))
    loaded = torch.export.load(str(tmp_path / "m.pt2")).module()
    for n in (1, 3, 17):
        x = torch.randn(n, 4)
        assert torch.allclose(loaded(x), model(x))


def test_out_of_memory_error_is_what_a_cpu_allocation_failure_raises_or_its_base():
    """search/failures.py classifies torch.OutOfMemoryError; it is a RuntimeError subclass at the top level."""
    assert issubclass(torch.OutOfMemoryError, RuntimeError)
    assert torch.OutOfMemoryError is torch.cuda.OutOfMemoryError


def test_scan_sees_aliases_and_chains(tmp_path):
    """The scanner itself: aliases resolve, and the longest chain is kept."""
    src = tmp_path / "m.py"
    src.write_text("import torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
                   "x = torch.linalg.vector_norm\ny = F.normalize\nz = nn.Linear.forward\n")
    names = torch_names_in(src)
    assert {"torch.linalg.vector_norm", "torch.nn.functional.normalize", "torch.nn.Linear.forward"} <= names
    assert "torch.linalg" not in names
