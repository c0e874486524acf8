"""The architecture's promises that a refactor could silently break: the scheduler and the block manager are
pure Python, and imports between the packages point one way (docs/ARCHITECTURE.md's map)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Higher imports lower, never the reverse: cli/commands -> server, tune -> batch_api -> batch, bench ->
# serving, the public API -> engine -> models, layers, loader and the shared leaf modules.
RANKS = {
    "cli": 6, "commands": 6,
    "server": 5, "tune": 5,
    "batch_api": 4,
    "batch": 3, "bench": 3,
    "serving": 2, "llm": 2, "qwenbatch": 2,
    "engine": 1,
}  # fmt: skip
LEAVES = 0  # config, settings, models, layers, loader, tokenizer, rerank, sampling_params, outputs


def _package_of(module: str) -> str:
    """``qwenbatch.engine.scheduler`` -> ``engine``; ``qwenbatch`` -> ``qwenbatch``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_imports() -> dict[str, set[str]]:
    """Package -> the other packages it imports, at any depth of its code (function-level imports too)."""
    edges: dict[str, set[str]] = {}
    for path in (SRC / "qwenbatch").rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        source = _package_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "qwenbatch" and _package_of(target) != source:
                    edges.setdefault(source, set()).add(_package_of(target))
    return edges


def test_imports_between_packages_point_down_the_layers():
    upward = [
        f"{src} -> {dst}"
        for src, targets in _package_imports().items()
        for dst in targets
        if RANKS.get(dst, LEAVES) > RANKS.get(src, LEAVES)
    ]
    assert not upward, f"imports against the layering: {upward}"


def test_no_import_cycle_between_packages():
    edges = _package_imports()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return [*path, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node, [])
            assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_scheduler_and_the_block_manager_import_without_torch_or_tokenizers():
    code = (
        "import sys\n"
        "for name in ('torch', 'tokenizers', 'transformers', 'numpy'):\n"
        "    sys.modules[name] = None  # any import of them raises ImportError\n"
        "import qwenbatch.engine.scheduler, qwenbatch.engine.block_manager\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
