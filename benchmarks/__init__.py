"""pockjax's benchmarks: the harness of ``pockjax bench`` (:mod:`benchmarks.harness`) and scripts.

They live in the source checkout, outside the ``pockjax`` package: importable
when the checkout's root is on ``sys.path``; the scripts run as
``python benchmarks/<name>.py``.
"""
