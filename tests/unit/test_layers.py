"""Every import between the project's top-level packages runs down the floors of
docs/architecture.md ("Floors and the import rule"): a package may import a package on a lower floor,
never one on its own floor or above. An `ast` walk over every module, lazy imports included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# floor -> packages; the same table as docs/architecture.md
FLOORS: dict[int, tuple[str, ...]] = {
    0: ("common", "scaling"),
    1: ("engine",),
    2: ("proto",),
    3: ("kv_transfer",),
    4: ("prefill_worker", "decode_worker"),
    5: ("router",),
    6: ("pdcluster",),
    7: ("loadgen",),
    8: ("planner",),
    9: ("benchmarks",),
    10: ("cli",),
}
FLOOR = {pkg: floor for floor, pkgs in FLOORS.items() for pkg in pkgs}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def upward_imports() -> list[str]:
    bad = []
    for pkg, floor in FLOOR.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for line, module in _imports(path):
                top = module.split(".")[0]
                if top in FLOOR and top != pkg and FLOOR[top] >= floor:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} "
                               f"(floor {FLOOR[top]} from floor {floor})")
    return bad


def test_every_import_runs_down():
    assert upward_imports() == []


def test_every_package_has_a_floor():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"}
    assert packages == set(FLOOR), "a new top-level package needs a floor here and in docs/architecture.md"


def test_the_architecture_page_lists_the_same_floors():
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.M)
    documented = {int(f): tuple(re.findall(r"`(\w+)/`", pkgs)) for f, pkgs in rows}
    assert documented == FLOORS


def test_the_router_and_the_client_import_no_torch_and_never_load_the_model_runner(builtin_path):
    import subprocess
    import sys

    imports = ("import sys, router.server, router.http_api, pdcluster.client, engine.request_checks, cli.main\n"
               "assert 'torch' not in sys.modules, 'importing the router or the client imported torch'\n")
    # what the router does with a model: its config, tokenizer and request checks (transformers'
    # Llama config imports torch itself; the model runner must stay out all the same)
    serve = ("from engine.config import ModelConfig\n"
             "from engine.request_checks import resolve_max_model_len, validate_request\n"
             "from engine.sampling_params import SamplingParams\n"
             "from engine.tokenizer import load_tokenizer\n"
             f"m = ModelConfig.from_pretrained({str(builtin_path)!r}); load_tokenizer({str(builtin_path)!r})\n"
             "validate_request([5, 6], SamplingParams(), m.vocab_size, resolve_max_model_len(m, None))\n"
             "assert 'engine.model_runner' not in sys.modules, 'the router loaded the model runner'\n")
    run = subprocess.run([sys.executable, "-c", imports + serve], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
