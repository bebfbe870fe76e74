"""Every Python snippet in README.md and the docs/ pages runs as written, as one script.

The README promises it; this runs them in one namespace, in a scratch directory,
in the order they appear: the README first, then the pages of :data:`DOC_PAGES`
(the order the reference material had when it was one file; later pages use
what earlier ones define). A snippet followed by "prints ...:" and a plain code
block must print output of that shape (digits masked: timings and the last
digits of losses differ between machines).
"""
from __future__ import annotations

import contextlib
import io
import re
from dataclasses import replace
from pathlib import Path

import pytest

import tncompile
from tncompile.planning import REFERENCE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOC_PAGES = ["compile.md", "hf.md", "export.md", "pretrained.md", "passes.md", "planning.md", "training.md", "distributed.md", "train-step.md",
             "layers-and-cli.md", "saving.md", "security.md", "guarantees.md", "status.md", "development.md", "evidence.md", "pretraining.md",
             "recommender.md"]


def all_snippets() -> list[tuple[str, str, str | None]]:
    """``(source, code, expected)`` for the README's snippets, then every page's."""
    out = [("README.md", code, expected) for code, expected in snippets(README.read_text())]
    for page in DOC_PAGES:
        out += [(f"docs/{page}", code, expected) for code, expected in snippets((ROOT / "docs" / page).read_text())]
    return out


def test_every_docs_page_is_run_and_linked():
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages == sorted(DOC_PAGES), "a docs/ page is missing from DOC_PAGES (its snippets would not run)"
    readme = README.read_text()
    assert all(f"docs/{page}" in readme for page in DOC_PAGES), "the README links every docs/ page"
    assert len(readme.splitlines()) < 300, "the README is for a user's first hour; reference goes to docs/"
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
    found = [(code, expected) for _, code, expected in all_snippets()]
    assert len(found) >= 10
    assert any(expected for _, expected in found), "the end-to-end example shows its output"


@pytest.mark.slow
def test_every_readme_snippet_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    # the README shows what a CPU user sees: layers judged with the reference CPU's speed, fixed costs included
    monkeypatch.setattr(tncompile.tuning, "DEVICE_SPEED", replace(REFERENCE, device="cpu"))
    namespace: dict = {"__name__": "readme"}
    for number, (source, code, expected) in enumerate(all_snippets(), 1):
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"{source} snippet {number}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{source} snippet {number} failed:\n{code}") from e
        if expected is not None:
            assert _shape(printed.getvalue()) == _shape(expected), \
                f"{source} snippet {number} printed\n{printed.getvalue()}\ninstead of\n{expected}"
    # what the snippets claim
    assert namespace["compiled"].ratio <= 0.01             # fit ends at or below the target
    assert (tmp_path / "ranks.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "ir").is_dir() and any((tmp_path / "ir").iterdir())
    assert 4096 in namespace["layer"].plans
