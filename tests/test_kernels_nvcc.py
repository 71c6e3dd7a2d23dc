"""Every .cu file compiles with nvcc for sm_90 and sm_80, with no register spills.

Templates produce no code until instantiated, so each file is compiled together with a tiny
wrapper that takes the address of every instantiation the backend launches
(cuda_launch.name_expressions()): the check covers exactly what runs. ptxas's `-v` report is
parsed per kernel: it must list every expected kernel (so the test cannot pass on an empty
cubin), with 0 bytes of spill stores / loads and a 0-byte stack frame (a local array indexed
at run time would live in slow local memory). Reports are cached by a hash of the inputs.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from cuda_sim.sim_module import cache_dir

from refserve.backends import cuda_launch as cl

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not installed")
ARCHS = ("sm_90", "sm_80")


def kernels_of(file_name: str) -> list[str]:
    """The name expressions whose kernel is defined in `file_name`."""
    source = cl.kernel_source(file_name)
    return [n for n in cl.name_expressions()
            if re.search(rf"\b{re.escape(n.split('<')[0])}\s*\(", source)]


def ptxas_report(file_name: str, arch: str) -> str:
    """nvcc's stderr for the file plus its instantiation wrapper (cached)."""
    names = kernels_of(file_name)
    wrapper = f'#include "{file_name}"\nvoid* refserve_instantiations[] = {{\n' + "".join(
        f"    (void*)&{n},\n" for n in names) + "};\n"
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(
        (wrapper + cl.kernel_source(file_name) + version + arch).encode()).hexdigest()[:16]
    cached = cache_dir() / "nvcc" / f"{file_name}.{arch}.{digest}.log"
    if cached.exists():
        return cached.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "instantiate.cu"
        src.write_text(wrapper)
        cmd = [NVCC, f"-arch={arch}", "-cubin", "-Xptxas", "-v", f"-I{cl.KERNEL_DIR}",
               str(src), "-o", str(Path(tmp) / "out.cubin")]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr[-6000:]}"
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(result.stderr)
    return result.stderr


def parse_ptxas(report: str) -> dict[str, dict[str, int]]:
    """Per compiled entry function: registers, stack frame, spill stores, spill loads."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = kernels.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", line)
        if m:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
    return kernels


def test_parse_ptxas_reads_spills():
    report = """ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
ptxas info    : Function properties for _Z3fooPf
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers"""
    assert parse_ptxas(report) == {"_Z3fooPf": {"stack": 8, "spill_stores": 4,
                                                "spill_loads": 12, "registers": 255}}


def test_every_launched_kernel_lives_in_some_file():
    found = [n for f in cl.KERNEL_FILES for n in kernels_of(f)]
    assert sorted(found) == sorted(cl.name_expressions())


def test_max_group_matches_the_kernel_source():
    source = cl.kernel_source("paged_attention.cu")
    assert re.search(rf"constexpr int kMaxGroup = {cl.MAX_GROUP};", source)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file_name", cl.KERNEL_FILES)
def test_kernels_compile_without_spills(file_name, arch):
    kernels = parse_ptxas(ptxas_report(file_name, arch))
    assert len(kernels) == len(kernels_of(file_name)), (
        f"{file_name}: ptxas compiled {len(kernels)} kernels, expected "
        f"{len(kernels_of(file_name))}")
    for name, info in kernels.items():
        assert info.get("spill_stores") == 0 and info.get("spill_loads") == 0, (
            f"{file_name} {arch}: {name} spills registers: {info}")
        assert info.get("stack") == 0, f"{file_name} {arch}: {name} uses local memory: {info}"
