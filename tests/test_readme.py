"""Every Python snippet in README.md runs as written, top to bottom, as one script.

The README promises it; this runs them in one namespace, in a scratch directory,
in the order they appear. A snippet followed by "prints ...:" and a plain code
block must print output of that shape (digits masked: timings and the last
digits of losses differ between machines).
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def snippets(text: str) -> list[tuple[str, str | None]]:
    """``(python code, expected output or None)`` for every ```python block."""
    blocks = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]
    out = []
    for i, (lang, body, _, end) in enumerate(blocks):
        if lang != "python":
            continue
        expected = None
        if i + 1 < len(blocks) and blocks[i + 1][0] == "":
            between = text[end:blocks[i + 1][2]].strip()
            if between.startswith("prints"):
                expected = blocks[i + 1][1]
        out.append((body, expected))
    return out


def _shape(text: str) -> list[str]:
    return [re.sub(r"\d+", "#", line.rstrip()) for line in text.strip().splitlines()]


def test_readme_has_snippets_with_expected_output():
    found = snippets(README.read_text())
    assert len(found) >= 10
    assert any(expected for _, expected in found), "the end-to-end example shows its output"


@pytest.mark.slow
def test_every_readme_snippet_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for number, (code, expected) in enumerate(snippets(README.read_text()), 1):
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"README.md snippet {number}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README snippet {number} failed:\n{code}") from e
        if expected is not None:
            assert _shape(printed.getvalue()) == _shape(expected), \
                f"README snippet {number} printed\n{printed.getvalue()}\ninstead of\n{expected}"
    # what the snippets claim
    assert namespace["compiled"].ratio <= 0.01             # fit ends at or below the target
    assert (tmp_path / "ranks.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "ir").is_dir() and any((tmp_path / "ir").iterdir())
    assert 4096 in namespace["layer"].plans
