"""Run the entry scripts with glibc's malloc tuned for XLA:CPU's per-step allocations (Linux).

XLA:CPU allocates a step's activations and temporaries with malloc and frees them when the
step ends. glibc's defaults hand large blocks back to the kernel (munmap, heap trimming), so
every step faults its memory in again, page by page. Two settings fix that:

* huge pages (`glibc.malloc.hugetlb=1`, where the kernel has transparent huge pages): malloc
  asks for 2 MiB pages, 512x fewer faults and TLB misses. The train step of
  bench/cpu_vs_pytorch.py went from 451 to 322 ms on a 2-core EPYC.
* memory kept (one arena, no mmap'd blocks, no trimming): freed blocks stay mapped and the next
  step reuses them without a fault. On top of huge pages, the same step: 650-1,000 faults and
  0.18-0.33 s of kernel time -> none, medians 943-1,044 -> 898-903 ms, resident memory 1.2 ->
  1.9 GB; the Multi30k main job 1.07x the steps/s (README, "Freed memory kept").

glibc reads GLIBC_TUNABLES only when a process starts, so an entry script re-executes itself
once with the settings added, before importing jax. A tunable the environment sets already is
left as it is; XFORMER_MALLOC_TUNING=0 opts out; glibc ignores tunables it does not know.
"""

import os
import sys

HUGE_PAGES = {"glibc.malloc.hugetlb": "1"}
KEEP_MEMORY = {
    "glibc.malloc.arena_max": "1",  # other threads' arenas give memory back on their own
    "glibc.malloc.mmap_max": "0",  # blocks past the mmap threshold would be munmapped on free
    "glibc.malloc.trim_threshold": str(2**63 - 1),
}
OPT_OUT = "XFORMER_MALLOC_TUNING"  # "0": leave the allocator as the environment has it
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_available() -> bool:
    """Whether the kernel has transparent huge pages and they are not switched off."""
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def tunables(current: str, huge_pages: bool) -> str:
    """GLIBC_TUNABLES `current` ("name=value:...") with ours added where it lacks them."""
    ours = {**(HUGE_PAGES if huge_pages else {}), **KEEP_MEMORY}
    present = {item.split("=", 1)[0] for item in current.split(":") if item}
    added = [f"{name}={value}" for name, value in ours.items() if name not in present]
    return ":".join(filter(None, [current, *added]))


def set_for_new_processes() -> bool:
    """Add the settings to this process's GLIBC_TUNABLES, which processes started from now on
    inherit; False where there is nothing to add, the user opted out or this is not Linux."""
    if sys.platform != "linux" or os.environ.get(OPT_OUT, "1") == "0":
        return False
    current = os.environ.get("GLIBC_TUNABLES", "")
    tuned = tunables(current, thp_available())
    os.environ["GLIBC_TUNABLES"] = tuned
    return tuned != current


def reexec_with_malloc_tuning() -> None:
    """Replace this process by the same command with `set_for_new_processes`' environment.
    Returns at once where `set_for_new_processes` adds nothing."""
    if not set_for_new_processes():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
