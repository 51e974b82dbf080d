import os
import sys

# Tests import the toy models beside them.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
