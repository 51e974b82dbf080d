"""IREE steps on the local CPU drivers keep their transient memory mapped between steps.

Each step allocates its transient buffers from the host heap and frees them
at the end; with glibc's defaults the freed blocks go back to the system and
the next step faults them in again (about 38,000 minor faults per step for
the step below, 172,000 for SmolLM2's ``paper`` step). pockjax sets glibc's
``M_MMAP_MAX``/``M_TRIM_THRESHOLD`` when it opens such a device
(:func:`pockjax.runtime.retain_freed_heap`); ``POCKJAX_RETAIN_HEAP=0`` keeps the defaults.
Each case runs in its own process: the setting is process-wide.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _fault_steps import assert_heap_kept, fault_script, run_script


pytestmark = pytest.mark.iree

_STEP = fault_script(
    prologue="from pockjax import runtime\n",
    scheme='llama_scheme("paper", config, blocks=1)',
    compile_args=', target="cpu"',
    report='{"retained": runtime.heap_retained()}',
    steps=8,
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_iree_step_stops_faulting_its_transients_in_again():
    kept, default = run_script(_STEP, retain_heap=True), run_script(_STEP, retain_heap=False)
    assert kept["retained"] and not default["retained"]
    # The first three steps fault the heap in; after that the kept heap serves the steps.
    assert_heap_kept(kept, default, warm_up=3, kept_below=2000, default_above=10000)
    assert kept["losses"] == default["losses"]  # the same arithmetic either way


def test_retain_freed_heap_is_idempotent_and_can_be_turned_off():
    code = ("from pockjax import runtime; "
            "print(runtime.retain_freed_heap(), runtime.retain_freed_heap(), runtime.heap_retained())")
    env = {k: v for k, v in os.environ.items() if k != "POCKJAX_RETAIN_HEAP"}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], env={**env, "POCKJAX_RETAIN_HEAP": "off"},
                         capture_output=True, text=True, check=True)
    assert on.stdout.split() == ["True", "True", "True"]
    assert off.stdout.split() == ["False", "False", "False"]
