"""The import rules between omnistep's planes (docs/architecture.md, "Planes and import
rules"), checked on every module's source, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "omnistep"

# plane -> the imports it must never make (a name matches itself and its submodules)
FORBIDDEN = {
    "core": ["omnistep.", "torch", "fastapi", "pydantic"],
    "kv": [
        "omnistep.engine",
        "omnistep.models",
        "omnistep.server",
        "omnistep.layers",
        "omnistep.runners",
        "torch",
    ],
    "engine": ["omnistep.models", "omnistep.server"],
    "models": ["omnistep.engine", "omnistep.server", "omnistep.cli", "omnistep.offline"],
    "layers": ["omnistep.engine", "omnistep.models", "omnistep.server"],
    "loops": ["omnistep.engine", "omnistep.models", "omnistep.server"],
    "sampling": ["omnistep.engine", "omnistep.models", "omnistep.server"],
    # framework adapters go through the offline API only
    "integrations": ["omnistep.engine", "omnistep.models", "omnistep.server", "omnistep.cli"],
}
ALLOWED_IN_CORE = ("omnistep.core",)

# plane -> the only omnistep planes it may import (everything else of omnistep is above it)
ONLY = {
    # torch building blocks import nothing above them
    "layers": ("omnistep.core", "omnistep.layers"),
    # the runner plane: what every family configures (vocoder wrapper, flow-matching math,
    # serving options); it sits on the blocks, loops, sampling and KV bookkeeping
    "runners": (
        "omnistep.core",
        "omnistep.kv",
        "omnistep.layers",
        "omnistep.loops",
        "omnistep.runners",
        "omnistep.sampling",
        "omnistep.text",
    ),
}


def _imports(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Every module name ``path`` (under ``root``) imports; relative imports made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = path.relative_to(root).with_suffix("").parts
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(parts[: len(parts) - node.level])
                names.append(f"{base}.{node.module}" if node.module else base)
            else:
                names.append(node.module or "")
    return names


def _breaks(name: str, rule: str) -> bool:
    if rule.endswith("."):
        return name.startswith(rule)
    return name == rule or name.startswith(rule + ".")


@pytest.mark.parametrize("plane", sorted(FORBIDDEN))
def test_plane_imports_follow_the_layer_rules(plane):
    broken = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted((PACKAGE / plane).rglob("*.py"))
        for name in _imports(path)
        for rule in FORBIDDEN[plane]
        if _breaks(name, rule) and not (plane == "core" and name.startswith(ALLOWED_IN_CORE))
    ]
    assert not broken, "\n".join(broken)


def _outside(name: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``name`` is an omnistep module outside every plane of ``allowed``."""
    return _breaks(name, "omnistep") and not any(_breaks(name, plane) for plane in allowed)


@pytest.mark.parametrize("plane", sorted(ONLY))
def test_plane_imports_only_the_planes_below_it(plane):
    assert (PACKAGE / plane / "__init__.py").is_file()
    broken = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted((PACKAGE / plane).rglob("*.py"))
        for name in _imports(path)
        if _outside(name, ONLY[plane])
    ]
    assert not broken, "\n".join(broken)


def test_the_allow_list_catches_an_import_from_above(tmp_path):
    module = tmp_path / "omnistep" / "runners" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("from omnistep.models.chattts import gpt\nfrom omnistep.kv import blocks\n")
    names = _imports(module, root=tmp_path)
    assert [n for n in names if _outside(n, ONLY["runners"])] == ["omnistep.models.chattts"]
    assert not _outside("torch", ONLY["runners"]) and not _outside("omnistep_extras", ())


def test_the_checker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    module = tmp_path / "omnistep" / "models" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "def f():\n    from omnistep.engine.engine import AsyncEngine\nfrom ..server import app\n"
    )
    names = _imports(module, root=tmp_path)
    assert sorted(names) == ["omnistep.engine.engine", "omnistep.server"]
    assert _breaks("omnistep.engine.engine", "omnistep.engine")
    assert not _breaks("omnistep.engineering", "omnistep.engine")


def test_production_code_never_imports_the_tests():
    broken = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in _imports(path)
        if _breaks(name, "tests")
    ]
    assert not broken, "\n".join(broken)


def test_no_model_family_imports_another():
    models = PACKAGE / "models"
    families = sorted(p.parent.name for p in models.glob("*/__init__.py"))
    assert {"chattts", "qwen3_tts", "qwen2_5_omni", "kokoro"} <= set(families)
    broken = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for family in families
        for path in sorted((models / family).rglob("*.py"))
        for name in _imports(path)
        for other in families
        if other != family and _breaks(name, f"omnistep.models.{other}")
    ]
    assert not broken, "\n".join(broken)


def test_family_folders_import_no_module_beside_the_families():
    """What families share lives in ``layers/`` or ``runners/``, not in a module of
    ``models/`` itself (only the registry, which imports the families, sits there)."""
    models = PACKAGE / "models"
    families = sorted(p.parent.name for p in models.glob("*/__init__.py"))
    beside = sorted(p.stem for p in models.glob("*.py") if p.stem != "__init__")
    assert beside == ["registry"], beside
    broken = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for family in families
        for path in sorted((models / family).rglob("*.py"))
        for name in _imports(path)
        if name.startswith("omnistep.models.") and name.split(".")[2] not in families
    ]
    assert not broken, "\n".join(broken)


def test_only_the_parity_plane_and_tests_use_the_parity_helpers():
    broken = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if PACKAGE / "parity" not in path.parents
        for name in _imports(path)
        if _breaks(name, "omnistep.parity")
    ]
    assert not broken, "\n".join(broken)
