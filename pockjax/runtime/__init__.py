"""JAX-free runtime for modules exported by pockjax (``iree.runtime`` + NumPy only).

Example (on the device)::

    import numpy as np
    from pockjax import runtime
    step = runtime.load("exported/")          # module.vmfb + module.json (+ weights.irpa)
    loss, = step.step(tokens=np.zeros((2, 16), np.int32), targets=...)
    step.save_weights("trained.irpa")

Nothing in this package imports JAX (or the rest of pockjax), and its modules
import each other relatively, so the ``runtime/`` folder also works copied to
a device on its own. By concern:

- :mod:`.metadata`: the exported files, :class:`TensorSpec`,
  :class:`ModuleMetadata` (``module.json``) and the errors;
- :mod:`.weights`: IREE parameter archives (``.irpa``) of named arrays;
- :mod:`.heap`: the host memory around IREE steps (glibc heap retention,
  resident size, the growth warning);
- :mod:`.session`: :class:`DeviceSession` (in process),
  :class:`CommandLineSession` (``iree-run-module``, e.g. under qemu),
  :class:`DeviceBuffer`, release of device objects at exit;
- :mod:`.module`: :class:`StatefulModule` (state kept on the device between
  steps) and :func:`load`.
"""

from .heap import (
    HEAP_DRIVERS,
    MEMORY_GROWTH_DRIVERS,
    RETAIN_HEAP_ENV,
    MemoryGrowthWarning,
    heap_off_by_env,
    heap_retained,
    process_rss_bytes,
    retain_freed_heap,
)
from .metadata import (
    METADATA_FILE,
    MODULE_FILE,
    WEIGHTS_FILE,
    InputError,
    ModuleError,
    ModuleMetadata,
    TargetMismatchError,
    TensorSpec,
    read_metadata,
)
from .module import StatefulModule, load
from .session import CommandLineSession, DeviceBuffer, DeviceSession
from .weights import load_weights, save_weights

__all__ = [
    "HEAP_DRIVERS",
    "MEMORY_GROWTH_DRIVERS",
    "RETAIN_HEAP_ENV",
    "METADATA_FILE",
    "MODULE_FILE",
    "WEIGHTS_FILE",
    "CommandLineSession",
    "DeviceBuffer",
    "DeviceSession",
    "InputError",
    "MemoryGrowthWarning",
    "ModuleError",
    "ModuleMetadata",
    "StatefulModule",
    "TargetMismatchError",
    "TensorSpec",
    "heap_off_by_env",
    "heap_retained",
    "load",
    "load_weights",
    "process_rss_bytes",
    "read_metadata",
    "retain_freed_heap",
    "save_weights",
]
