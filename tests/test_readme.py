"""The README's "use the pure functions" snippet must keep running as printed."""

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippet_runs_and_chunked_matches_recurrent():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README lost its python snippet"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert namespace["o"].shape == (1, 200, 2, 64)
    assert namespace["state"].shape == (1, 2, 64, 64)
    np.testing.assert_allclose(namespace["o"], namespace["o_ref"], atol=1e-4)
