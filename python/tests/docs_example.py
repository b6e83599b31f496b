"""The example code of docs/python.md and examples/torch (found from a checkout)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "python.md"
TP_MLP = REPO / "examples" / "torch" / "tp_mlp.py"


def doc_example() -> str | None:
    """The first ```python block of docs/python.md, or None outside a checkout."""
    if not DOC.is_file():
        return None
    return re.search(r"```python\n(.*?)```", DOC.read_text(), flags=re.S).group(1)
