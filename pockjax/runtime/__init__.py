"""JAX-free runtime for modules exported by pockjax (``iree.runtime`` + NumPy only).

Example (on the device)::

    import numpy as np
    from pockjax import runtime
    step = runtime.load("exported/")          # module.vmfb + module.json (+ weights.irpa)
    loss, = step.step(tokens=np.zeros((2, 16), np.int32), targets=...)
    step.save_weights("trained.irpa")
"""

from pockjax.runtime.module import (
    MEMORY_GROWTH_DRIVERS,
    METADATA_FILE,
    MODULE_FILE,
    WEIGHTS_FILE,
    CommandLineSession,
    DeviceBuffer,
    DeviceSession,
    InputError,
    MemoryGrowthWarning,
    ModuleError,
    ModuleMetadata,
    StatefulModule,
    TargetMismatchError,
    TensorSpec,
    load,
    load_weights,
    process_rss_bytes,
    read_metadata,
    save_weights,
)

__all__ = [
    "MEMORY_GROWTH_DRIVERS",
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
    "load",
    "load_weights",
    "process_rss_bytes",
    "read_metadata",
    "save_weights",
]
