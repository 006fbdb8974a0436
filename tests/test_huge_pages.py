"""Entry scripts re-execute themselves once with glibc's malloc on transparent huge pages."""

import os
import subprocess
import sys

import pytest

from xformer import huge_pages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(
    not huge_pages.wanted({}), reason="not Linux, or transparent huge pages are off"
)

# Prints its pid before and after the re-execution, then how much of a 64 MiB malloc'd and
# written block the kernel backs with huge pages (/proc/self/smaps_rollup AnonHugePages).
PROGRAM = f"""
import ctypes, os, sys
sys.path.insert(0, {ROOT!r})
from xformer.huge_pages import reexec_with_huge_pages
print("pid", os.getpid(), flush=True)
reexec_with_huge_pages()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print("tunables", os.environ.get("GLIBC_TUNABLES"))
print("huge_kib", int(huge[0].split()[1]) if huge else -1)
"""


def run(**env) -> dict:
    ours = ("GLIBC_TUNABLES", huge_pages.OPT_OUT)
    environ = {k: v for k, v in os.environ.items() if k not in ours}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env={**environ, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    lines = [line.split(" ", 1) for line in out.stdout.splitlines()]
    return {"pids": [v for k, v in lines if k == "pid"], **{k: v for k, v in lines if k != "pid"}}


def test_reexecutes_once_with_the_tunable_added_to_the_others():
    got = run(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")
    assert len(got["pids"]) == 2 and got["pids"][0] == got["pids"][1]  # exec, not a child
    assert got["tunables"] == "glibc.malloc.trim_threshold=1048576:glibc.malloc.hugetlb=1"
    assert int(got["huge_kib"]) >= 16 << 10  # 0 on 4 KiB pages; 62 of the 64 MiB measured


def test_opt_out_and_an_existing_setting_leave_the_process_alone():
    for env in ({"XFORMER_HUGE_PAGES": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}):
        got = run(**env)
        assert len(got["pids"]) == 1
        assert got["tunables"] == env.get("GLIBC_TUNABLES", "None")
