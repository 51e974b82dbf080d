"""Every tutorial in docs/ runs: its ```python blocks, in order, as one script."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
TUTORIALS = sorted(p for p in DOCS.glob("*.md") if "```python" in p.read_text())


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorial_runs(path, capsys):
    text = path.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{path.name} has no python blocks"
    namespace = {"__name__": f"docs_{path.stem}"}
    exec(compile("\n".join(blocks), str(path), "exec"), namespace)
