"""In-process CPU steps reuse their working memory between steps (pockjax.keep_step_memory).

XLA's CPU client allocates a step's temporaries when it starts and frees them when
it ends; with JAX's asynchronous dispatch that happens on a worker thread whose
glibc arena maps every block above 32 MiB afresh, so each step faulted its
temporaries in again. :func:`pockjax.keep_step_memory` runs CPU steps on the
calling thread and keeps freed heap mapped. Each case runs in its own process:
the settings are process-wide and must come before JAX starts its CPU client.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
from _fault_steps import assert_heap_kept, fault_script, run_script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

_STEP = fault_script(
    prologue="""
    import warnings
    import pockjax
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = pockjax.keep_step_memory()
    """,
    scheme='llama_scheme("full", config)',
    report='{"kept": kept, "async": jax.config.read("jax_cpu_enable_async_dispatch"),'
           ' "warnings": [str(w.message) for w in caught]}',
    steps=8,
)


def test_cpu_step_stops_faulting_its_temporaries_in_again():
    kept, default = run_script(_STEP, retain_heap=True), run_script(_STEP, retain_heap=False)
    assert kept["kept"] and not kept["async"] and kept["warnings"] == []
    assert not default["kept"] and default["async"]
    assert "POCKJAX_RETAIN_HEAP" in default["warnings"][0]
    # About 300-3,000 faults per step kept, about 80,000 by default, after two warm-up steps.
    assert_heap_kept(kept, default, warm_up=2, kept_below=10000, default_above=40000)
    assert kept["losses"] == default["losses"]  # the same arithmetic either way


def test_keep_step_memory_after_jax_started_changes_nothing_and_says_when_to_call_it():
    code = textwrap.dedent(
        """
        import json, warnings
        import jax, jax.numpy as jnp
        import pockjax
        jnp.ones(3).block_until_ready()          # JAX's CPU client now exists
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = pockjax.keep_step_memory()
            quiet = pockjax.keep_step_memory(quiet=True)
        print(json.dumps({"first": first, "quiet": quiet, "kept": pockjax.step_memory_kept(),
                          "async": jax.config.read("jax_cpu_enable_async_dispatch"),
                          "warnings": [str(w.message) for w in caught]}))
        """
    )
    got = run_script(code, retain_heap=True)
    assert got["first"] is False and got["quiet"] is False and got["kept"] is False
    assert got["async"] is True  # left as it was
    assert len(got["warnings"]) == 1 and "before the first JAX computation" in got["warnings"][0]


def test_keep_step_memory_is_idempotent():
    code = ("import json, pockjax, jax; a = pockjax.keep_step_memory(); b = pockjax.keep_step_memory(); "
            "print(json.dumps([a, b, pockjax.step_memory_kept(), jax.config.read('jax_cpu_enable_async_dispatch')]))")
    assert run_script(code, retain_heap=True) == [True, True, True, False]
