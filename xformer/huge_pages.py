"""Run the entry scripts with glibc's malloc backed by transparent huge pages (Linux).

XLA:CPU allocates a step's activations and temporaries with malloc. With 4 KiB pages, the train
step of bench/cpu_vs_pytorch.py took 0.39-0.41 s on a 2-core EPYC; with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35: malloc asks for transparent huge pages)
it took 0.30 s, with the same matmul ceiling. glibc reads the tunable only when a process
starts, so an entry script re-executes itself once with it set, before importing jax.
XFORMER_HUGE_PAGES=0 opts out; where glibc does not know the tunable it is ignored.
"""

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "XFORMER_HUGE_PAGES"  # "0": leave the allocator as the environment has it
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_available() -> bool:
    """Whether the kernel has transparent huge pages and they are not switched off."""
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def wanted(environ: dict | None = None) -> bool:
    """Whether this process should re-execute itself to get huge pages."""
    environ = os.environ if environ is None else environ
    return (
        sys.platform == "linux"
        and environ.get(OPT_OUT, "1") != "0"
        and TUNABLE not in environ.get("GLIBC_TUNABLES", "")
        and thp_available()
    )


def set_for_new_processes() -> bool:
    """GLIBC_TUNABLES += glibc.malloc.hugetlb=1 (other tunables kept) in this process's
    environment, which processes started from now on inherit; False where not `wanted`."""
    if not wanted():
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, f"{TUNABLE}=1"]))
    return True


def reexec_with_huge_pages() -> None:
    """Replace this process by the same command with `set_for_new_processes`' environment.
    Returns at once where that is set already, opted out or useless."""
    if not set_for_new_processes():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
