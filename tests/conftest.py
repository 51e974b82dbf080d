import os
import sys

# Tests import the toy models beside them, and the benchmark harness
# (benchmarks.harness) from the checkout's root.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
# XLA's CPU programs are compiled with LLVM at -O0 (XLA's default is 3): the same HLO
# programs (XLA's own passes, fusion and buffer assignment run as usual), only the kernels'
# machine code is less optimised. Compiling is most of the suite's time on 2 cores, and this
# cut it by a fifth (212 against 269 s on five heavy files). The subprocesses the tests start
# inherit it. test_xla_default_level checks the steps at XLA's default level against it;
# POCKJAX_TEST_XLA_DEFAULT_OPT=1 runs the whole suite at the default level.
if os.environ.get("POCKJAX_TEST_XLA_DEFAULT_OPT") != "1" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One XLA (and IREE) compilation cache for the whole test run, shared by the xdist workers and
# the subprocesses the tests start (they inherit the environment): many tests compile the same
# tiny-model steps, and on 2 cores compiling is most of the suite's time. The folder is new
# for each run (nothing carries over from an earlier run) and removed at its end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="pockjax-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["POCKJAX_IREE_CACHE_DIR"] = os.path.join(_cache, "iree")  # the same for iree-compile
    _owner = os.getpid()
    atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(_cache, ignore_errors=True))

import pytest  # noqa: E402

_SLOW_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


def _slow_ids() -> set[str]:
    with open(_SLOW_LIST, encoding="utf-8") as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests listed in slow_tests.txt ``slow`` (doctests included)."""
    slow = _slow_ids()
    for item in items:
        # a parametrized test is listed once, without its parameters
        if item.nodeid in slow or item.nodeid.split("[", 1)[0] in slow:
            item.add_marker(pytest.mark.slow)
