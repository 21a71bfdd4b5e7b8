"""Each room imports only the rooms below it (docs/architecture.md, "Rooms and imports")."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom first; a module outside every room listed here is an entry point, the top.
ROOMS = (
    ("pallas_kernels",),
    ("jaxspec.errors", "jaxspec.files", "jaxspec.tokenizer", "jaxspec.corpus", "jaxspec.xla_flags"),
    ("jaxspec.models",),
    ("jaxspec.loaders",),
    ("jaxspec.decoding",),
    ("jaxspec.planner",),
    ("jaxspec.training",),
    ("jaxspec.serving",),
    ("jaxspec.runner",),
)
TOP = len(ROOMS)


def level(module: str) -> int | None:
    """The room of a jaxspec or pallas_kernels module; None for other packages and `jaxspec` itself."""
    for i, room in enumerate(ROOMS):
        if any(module == name or module.startswith(name + ".") for name in room):
            return i
    return TOP if module.startswith("jaxspec.") else None


def imported(tree: ast.Module) -> set[str]:
    """Every module an import statement names, `from a import b` as both a and a.b (b may be a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_room_imports_a_room_above_it():
    upward = []
    for path in sorted([*ROOT.glob("jaxspec/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        own = level(module)
        for name in imported(ast.parse(path.read_text())):
            other = level(name)
            if other is not None and other > own:
                upward.append(f"{module} imports {name}")
    assert not upward, upward


def test_the_rule_sees_an_upward_import():
    tree = ast.parse("from jaxspec.serving.scheduler import Scheduler\nimport jaxspec.runner")
    assert {level(name) for name in imported(tree)} == {level("jaxspec.serving"), level("jaxspec.runner")}
    assert level("jaxspec.models.decoder") < level("jaxspec.decoding.engine") < level("jaxspec.generate")
