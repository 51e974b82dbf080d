import os
import sys

# Tests import the toy models beside them, and the benchmark harness
# (benchmarks.harness) from the checkout's root.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

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
