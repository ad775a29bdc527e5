"""Building and loading the CPU kernels (``cpu_kernels.cpp``) on first use.

The source ships with the package; the shared library is compiled once per machine with the
system's C++ compiler (``g++ -O3 -march=native -fopenmp``) into a cache folder keyed by the
source, the flags, the compiler and the CPU's feature flags, then loaded with ctypes. No
compiler, or a failed build, is not an error: `load_cpu_kernel` returns ``None`` with the
reason, and the caller falls back to the reference backend and says so in a log line.

A build goes to a temporary file renamed into place, so concurrent first uses (several test
workers, several servers) never load a half-written library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
DEFAULT_KERNEL_CACHE = Path("~/.cache/kvpilot/kernels")
ABI_VERSION = 2
# -ffp-contract=off: element-wise ops round like torch's (no implicit FMA); the attention
# loops use explicit FMA intrinsics.
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c++17",
)
BUILD_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class KernelLoad:
    """The loaded library, or why there is none (``library`` None, ``reason`` set)."""

    library: ctypes.CDLL | None
    reason: str
    path: Path | None = None


_lock = threading.Lock()
_loaded: dict[Path, KernelLoad] = {}


def _compiler() -> str | None:
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_key(compiler: str) -> str:
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = compiler
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode()):
        digest.update(part)
    digest.update(_cpu_flags().encode())
    digest.update(platform.machine().encode())
    return digest.hexdigest()[:16]


def _bind(library: ctypes.CDLL) -> None:
    ptr = ctypes.c_void_p
    fn = library.kvpilot_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int,  # dtype
        ptr,  # q
        ptr,  # k cache
        ptr,  # v cache
        ptr,  # out
        ptr,  # q_start (int64)
        ptr,  # q_len (int64)
        ptr,  # ctx_len (int64)
        ptr,  # block tables (int64)
        ctypes.c_int64,  # table stride
        ctypes.c_int64,  # works
        ctypes.c_int64,  # H
        ctypes.c_int64,  # H_kv
        ctypes.c_int64,  # D
        ctypes.c_int64,  # B
        ctypes.c_int64,  # window
        ctypes.c_float,  # scale
        ctypes.c_int,  # threads
    ]
    i64, f32, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_int
    norm = library.kvpilot_add_rms_norm
    norm.restype = i32
    norm.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    silu = library.kvpilot_silu_mul
    silu.restype = i32
    silu.argtypes = [i32, ptr, ptr, i64, i64, i32]
    rope = library.kvpilot_rope
    rope.restype = i32
    rope.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    library.kvpilot_kernel_abi_version.restype = i32


def _build(target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        result = subprocess.run(
            [compiler, *FLAGS, "-o", str(staging), str(SOURCE)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


def load_cpu_kernel(cache_dir: Path | None = None) -> KernelLoad:
    """The compiled kernel library (built on first use), or the reason it is unavailable."""
    root = Path(cache_dir or DEFAULT_KERNEL_CACHE).expanduser()
    with _lock:
        if root in _loaded:
            return _loaded[root]
        _loaded[root] = _load(root)
        return _loaded[root]


def _load(root: Path) -> KernelLoad:
    compiler = _compiler()
    if compiler is None:
        return KernelLoad(None, "no C++ compiler (g++, c++ or clang++) on PATH")
    target = root / _cache_key(compiler) / "libkvpilot_cpu_kernels.so"
    try:
        if not target.is_file():
            _build(target, compiler)
        library = ctypes.CDLL(str(target))
        _bind(library)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        return KernelLoad(None, f"building the CPU attention kernel failed: {exc}")
    version = library.kvpilot_kernel_abi_version()
    if version != ABI_VERSION:
        return KernelLoad(None, f"kernel ABI {version} != expected {ABI_VERSION} at {target}")
    return KernelLoad(library, "", target)
