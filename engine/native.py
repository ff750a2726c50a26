"""The engine's native CPU kernels (engine/csrc), built on first use: paged decode attention (and
its bfloat16 form on AMX tiles), prefill attention and linear layers on the vector units (panels), a mixture-of-experts layer's routed experts (float32; and
bfloat16 on AMX tiles), and the per-token steps of a layer (RMSNorm, RoPE: engine/token_ops.py).

The C sources are compiled with the host's C compiler (`$CC`, else cc / gcc) for this CPU
(`-O3 -march=native`) into `$PDCLUSTER_CACHE/native/` (default ~/.cache/pdcluster), named by a
hash of the source, the flags and the CPU's feature flags, and loaded with ctypes (a call
releases the GIL). Building takes about a second and happens once per machine; concurrent
processes take a file lock. Where no compiler is found or the build fails, `native_lib()`
returns None and the engine keeps its torch path (a warning says why, once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from engine.builtin_model import cache_root, file_lock

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
HEADERS = sorted(CSRC.glob("*.h"))
FLAGS = ["-O3", "-fPIC", "-shared"]
MARCH = "native"  # the instruction sets the kernels are built for (`library_for` builds others)
# OpenMP: the kernels then run on torch's own OpenMP threads (libgomp.so.1, which torch has already
# loaded, is the one the dynamic loader binds); where the compiler lacks it, POSIX threads.
OPENMP = ["-fopenmp"]
LIBS = ["-lpthread", "-lm"]
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(cc: str, march: str = MARCH) -> Path:
    flags = [f"-march={march}", *FLAGS]
    try:
        return _build_with(cc, flags + OPENMP)
    except (RuntimeError, subprocess.SubprocessError) as e:
        log.info("native kernels: building without OpenMP (%s)", e)
        return _build_with(cc, flags)


def _build_with(cc: str, flags: list[str]) -> Path:
    text = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    key = hashlib.sha256(text + " ".join([cc, *flags]).encode() + _cpu_flags().encode()).hexdigest()[:16]
    out_dir = cache_root() / "native"
    target = out_dir / f"pdcluster_kernels-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir / f".{target.name}.lock"):
        if target.is_file():
            return target
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES), *LIBS], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} exited with {proc.returncode}: {proc.stderr.strip()[:500]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.paged_decode_attention
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [p, i64, p, p, p, p, p, p, i, i, i, i, i, i, i, ctypes.c_float, i, i, i]
    fn.restype = ctypes.c_int
    fn = lib.decode_attention_amx
    fn.argtypes = [p, i64, p, p, p, p, p, p, i, i, i, i, i, i, i, ctypes.c_float, i]
    fn.restype = ctypes.c_int
    fn = lib.moe_experts
    fn.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i]
    fn.restype = ctypes.c_int
    fn = lib.moe_experts_bf16
    fn.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, i]
    fn.restype = ctypes.c_int
    fn = lib.pd_linear_bf16
    fn.argtypes = [p, i64, p, p, p, i, i, i, i]
    fn.restype = ctypes.c_int
    fn = lib.pd_linear_panels
    fn.argtypes = [p, i64, p, p, p, i, i, i, i, i, i]
    fn.restype = ctypes.c_int
    fn = lib.pd_prefill_attention
    fn.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64, i, i, i, i, i, i, i, ctypes.c_float, i, i]
    fn.restype = ctypes.c_int
    lib.pd_linear_panels_dtypes.argtypes = []
    lib.pd_linear_panels_dtypes.restype = ctypes.c_int
    fn = lib.pd_attention_block_bf16
    fn.argtypes = [p] * 20 + [i] * 7 + [ctypes.c_float] * 2 + [i, i]
    fn.restype = ctypes.c_int
    fn = lib.pd_attention_block_panels
    fn.argtypes = [p] * 20 + [i] * 7 + [ctypes.c_float] * 2 + [i, i]
    fn.restype = ctypes.c_int
    fn = lib.pd_mlp_panels
    fn.argtypes = [p] * 4 + [i] * 5
    fn.restype = ctypes.c_int
    fn = lib.pd_moe_block_bf16
    fn.argtypes = [p] * 5 + [i] * 8
    fn.restype = ctypes.c_int
    fn = lib.pd_linear_heads_bf16
    fn.argtypes = [p, i64, i64, p, p, i64, i64, i, i, i, i, i]
    fn.restype = ctypes.c_int
    fn = lib.pd_rms_norm
    fn.argtypes = [p, ctypes.c_long, p, p, p, p, i, i, ctypes.c_float, i, i]
    fn.restype = ctypes.c_int
    fn = lib.pd_rope
    fn.argtypes = [p, ctypes.c_long, ctypes.c_long, p, p, p, p, p, ctypes.c_long, ctypes.c_long, i, i, i, i,
                   ctypes.c_float, i, i]
    fn.restype = ctypes.c_int
    fn = lib.pd_route_softmax
    fn.argtypes = [p, p, p, i, i, i, i, i, i, i, p, p]
    fn.restype = ctypes.c_int
    fn = lib.pd_route_grouped
    fn.argtypes = [p, p, p, p, i, i, i, i, i, i, i, i, ctypes.c_float, p, p]
    fn.restype = ctypes.c_int
    lib.pd_amx_ready.argtypes = []
    lib.pd_amx_ready.restype = ctypes.c_int
    return lib


def library_for(march: str) -> ctypes.CDLL:
    """The kernels built for another instruction set (`-march=haswell`: AVX2 without AVX-512), for
    tests of the paths this CPU would not take; raises where no compiler builds it."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found")
    return _load(_build(cc, march))


def native_lib() -> ctypes.CDLL | None:
    """The loaded kernel library, built if needed; None where it cannot be (the reason is logged)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("PDCLUSTER_NO_NATIVE"):
            return None
        cc = _compiler()
        if cc is None:
            log.warning("no C compiler found (cc, gcc, clang or $CC): the engine runs without its native kernels")
            return None
        try:
            _lib = _load(_build(cc))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("native kernels unavailable, the engine runs without them: %s", e)
            _lib = None
        return _lib
