"""The light stages start without torch: only the engine stage loads the model (DESIGN §5)."""

from __future__ import annotations

import subprocess
import sys

LIGHT = ("gateway", "auth", "context", "tokenize", "detokenize", "ledger", "edge.app")


def test_light_stages_import_no_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import stages.{name}\n" for name in LIGHT)
        + "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"a light stage pulled in {out.stdout.strip()}"
