import os
import sys

# Tests import the toy models beside them, and the benchmark harness
# (benchmarks.harness) from the checkout's root.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
