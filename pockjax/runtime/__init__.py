"""JAX-free runtime for modules exported by pockjax (``iree.runtime`` + NumPy only).

Example (on the device)::

    import numpy as np
    from pockjax import runtime
    step = runtime.load("exported/")          # module.vmfb + module.json (+ weights.irpa)
    loss, = step.step(tokens=np.zeros((2, 16), np.int32), targets=...)
    step.save_weights("trained.irpa")
"""

from pockjax.runtime.module import (
    HEAP_DRIVERS,
    MEMORY_GROWTH_DRIVERS,
    RETAIN_HEAP_ENV,
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
    heap_off_by_env,
    heap_retained,
    process_rss_bytes,
    read_metadata,
    retain_freed_heap,
    save_weights,
)

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
