"""scripts/gpu_check.py runs end to end on CPU (`--device cpu --quick`) and every check passes, so
the script is known to work before a GPU ever runs it: its GPU branches differ from these in the
device string, the dtype and the Ray resources only.

The cluster whose KV goes over torch_distributed (gloo here) is left out by default: each cluster
costs about a minute on two cores (most of it Ray's own shutdown at `pdcluster down`), and its code
is the KV-auto cluster's with another backend. PDCLUSTER_GPU_CHECK_ALL=1 runs it too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import SHAPES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(?P<name>.+?)\s+(?P<verdict>PASS|FAIL|SKIP|INFO)\s+[\d.]+s  (?P<detail>.*)$")


def test_gpu_check_runs_on_cpu_and_every_check_passes():
    run_all = os.environ.get("PDCLUSTER_GPU_CHECK_ALL") == "1"
    skip = [] if run_all else ["--skip", "torch_distributed"]
    command = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--budget-s", "420"]
    proc = subprocess.run(command + skip, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    rows = {}
    for text in proc.stdout.splitlines():  # nothing but one line per check
        m = LINE.match(text)
        assert m, f"not a check's line: {text!r}"
        rows[m["name"]] = (m["verdict"], m["detail"])
    info = {"device", "cuda graphs", "throughput vs transformers"}
    assert {name for name, (verdict, _) in rows.items() if verdict != "PASS"} == info, proc.stdout
    parity = [name for name in rows if name.startswith("parity ")]
    assert len(parity) == len(SHAPES) + 2 + 1, parity  # float32 each, two in bfloat16, the built-in model
    assert all("colocated + disaggregated" in rows[name][1] for name in parity)
    assert "tensor parallel 2 over gloo" in rows
    assert rows["cuda graphs"][1] == "not built (engine runs eager on CUDA)"
    assert "KV backend shm" in rows["cluster P+D on CPU, KV auto"][1]
    if run_all:
        assert "KV backend torch_distributed" in rows["cluster P+D on CPU, KV torch_distributed (gloo)"][1]
