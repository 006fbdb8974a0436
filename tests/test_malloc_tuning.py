"""Entry scripts re-execute themselves once with glibc's malloc on huge pages and keeping the
memory it frees."""

import os
import subprocess
import sys

import pytest

from xformer import malloc_tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables: Linux only")
KEEP = ":".join(f"{k}={v}" for k, v in malloc_tuning.KEEP_MEMORY.items())

# Prints its pid before and after the re-execution; mallocs, writes and frees a 64 MiB block
# twice (an XLA:CPU step's temporaries, twice), then prints how much of it the kernel backs
# with huge pages (/proc/self/smaps_rollup AnonHugePages) and the page faults of the second
# round (getrusage).
PROGRAM = f"""
import ctypes, os, resource, sys
sys.path.insert(0, {ROOT!r})
from xformer.malloc_tuning import reexec_with_malloc_tuning
print("pid", os.getpid(), flush=True)
reexec_with_malloc_tuning()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("tunables", os.environ.get("GLIBC_TUNABLES"))
print("huge_kib", int(huge[0].split()[1]) if huge else -1)
print("faults", *faults)
"""


def run(**env) -> dict:
    ours = ("GLIBC_TUNABLES", malloc_tuning.OPT_OUT)
    environ = {k: v for k, v in os.environ.items() if k not in ours}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env={**environ, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    lines = [line.split(" ", 1) for line in out.stdout.splitlines()]
    return {"pids": [v for k, v in lines if k == "pid"], **{k: v for k, v in lines if k != "pid"}}


def test_tunables_are_added_to_the_environments_and_never_override_them():
    assert malloc_tuning.tunables("", huge_pages=False) == KEEP
    huge = "glibc.malloc.hugetlb=1"
    assert malloc_tuning.tunables("a.b=1", huge_pages=True) == f"a.b=1:{huge}:{KEEP}"
    mine = "glibc.malloc.trim_threshold=1048576:glibc.malloc.hugetlb=0"
    assert malloc_tuning.tunables(mine, huge_pages=True) == (
        f"{mine}:glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0"
    )
    done = malloc_tuning.tunables("", huge_pages=True)
    assert malloc_tuning.tunables(done, huge_pages=True) == done  # hence one re-execution


def test_reexecutes_once_and_the_second_round_of_a_freed_block_needs_no_page_faults():
    got = run(GLIBC_TUNABLES="glibc.malloc.perturb=0")
    assert len(got["pids"]) == 2 and got["pids"][0] == got["pids"][1]  # exec, not a child
    thp = malloc_tuning.thp_available()
    assert got["tunables"] == malloc_tuning.tunables("glibc.malloc.perturb=0", thp)
    first, second = map(int, got["faults"].split())
    assert second <= 16 < first, got  # 0 measured; munmapped memory faults again on reuse
    if thp:
        assert int(got["huge_kib"]) >= 16 << 10  # 0 on 4 KiB pages; 62 of the 64 MiB measured


def test_opt_out_and_complete_settings_leave_the_process_alone():
    untuned = run(XFORMER_MALLOC_TUNING="0")
    assert len(untuned["pids"]) == 1 and untuned["tunables"] == "None"
    first, second = map(int, untuned["faults"].split())
    assert second > 16  # glibc's defaults give the block back: the control of the test above
    complete = malloc_tuning.tunables("", huge_pages=True)
    got = run(GLIBC_TUNABLES=complete)
    assert len(got["pids"]) == 1 and got["tunables"] == complete
