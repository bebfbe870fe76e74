"""The docs say what the code is: names, tuned values, paths and file lists, checked.

Issue 68 found 5 of 7 checked claims stale (a deleted ``tuning`` flag still documented and
still set by a benchmark, files missing from ARCHITECTURE.md's lists). Each check here
reads the Markdown pages (and the benchmarks' and examples' code for ``tuning`` names) and
fails on drift; each has a test that it finds a planted one.
"""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from test_architecture import LAYERS, PACKAGE, imported, module_name, sources

ROOT = PACKAGE.parent

#: paths the docs name that a run writes (not in a clean clone), and what writes each
WRITTEN_BY_RUNS = {
    "runs/demo/demo.png": "examples/demo.py (the quickstart's demo)",
    "benchmarks/results/pretrain.json": "python benchmarks/bench_pretrain.py --phases report (issue 66's study)",
}


def doc_pages() -> list[Path]:
    """Every Markdown page a user or contributor reads."""
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.md")), *sorted((ROOT / "examples").glob("*.md")),
             *sorted(PACKAGE.rglob("README.md"))]
    return [p for p in pages if p.exists()]


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def resolves(dotted: str) -> bool:
    """``tncompile.a.b.c``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def stale_names(text: str) -> list[str]:
    """``tncompile.…`` names in code spans that name nothing."""
    found = {m for code in backticked(text)
             for m in re.findall(r"(?<![\w/])tncompile(?:\.[A-Za-z_]\w*)+", code)}
    return sorted(n for n in found if not resolves(n))


def stale_tuning_in_text(text: str) -> list[str]:
    from tncompile import tuning
    found = {m for code in backticked(text) for m in re.findall(r"\btuning\.([A-Z][A-Z0-9_]*)\b", code)}
    return sorted(n for n in found if not hasattr(tuning, n))


def stale_tuning_in_code(source: str) -> list[str]:
    """``tuning.NAME`` read or set, and ``tuning.override(NAME=...)``, naming no tuned value."""
    from tncompile import tuning
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.isupper() and (
                (isinstance(node.value, ast.Name) and node.value.id == "tuning")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "tuning")):
            names.add(node.attr)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "override"
                and isinstance(node.func.value, (ast.Name, ast.Attribute))):
            names.update(k.arg for k in node.keywords if k.arg and k.arg.isupper())
    return sorted(n for n in names if not hasattr(tuning, n))


def _roots(page: Path) -> list[Path]:
    return [ROOT, PACKAGE, page.parent, PACKAGE / "runtime"]


def stale_paths(page: Path, text: str) -> list[str]:
    """Paths into this repository's folders (first part an existing folder) that do not
    exist, from code spans and relative links; ``WRITTEN_BY_RUNS`` excepted."""
    spans = [m for code in backticked(text)
             for m in re.findall(r"(?<![\w/.$])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|png|sh|toml|txt))\b", code)]
    links = [m for m in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in m and not m.startswith("mailto:")]
    stale = []
    for path in spans:
        roots = [r for r in _roots(page) if (r / path.split("/")[0]).is_dir()]
        if roots and path not in WRITTEN_BY_RUNS and not any((r / path).exists() for r in roots):
            stale.append(path)
    stale += [link for link in links if not (page.parent / link).exists() and link not in WRITTEN_BY_RUNS]
    return sorted(set(stale))


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_tuned_value_and_path_a_page_gives_exists(page):
    text = page.read_text()
    assert stale_names(text) == [], f"{page.relative_to(ROOT)} names what the package does not have"
    assert stale_tuning_in_text(text) == [], f"{page.relative_to(ROOT)} names a tuned value tncompile.tuning lacks"
    assert stale_paths(page, text) == [], f"{page.relative_to(ROOT)} names paths that do not exist"


@pytest.mark.parametrize("path", sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmarks_and_examples_set_only_tuned_values_that_exist(path):
    """A benchmark that sets a deleted flag measures nothing it names."""
    assert stale_tuning_in_code(path.read_text()) == []


def test_the_checks_find_planted_drift(tmp_path):
    page = tmp_path / "page.md"
    text = ("`tncompile.compile` `tncompile.runtime.ways.lookup.LookupWay` `tuning.WHOLE_TABLE_SLACK`\n"
            "`tncompile.runtime.no_such_module.f` `tncompile.compile.nothing` `tuning.DELETED_FLAG`\n"
            "`docs/no-such-page.md` `runtime/ways/lookup.py` `folder/config.json` [gone](missing.md)\n")
    page.write_text(text)
    assert stale_names(text) == ["tncompile.compile.nothing", "tncompile.runtime.no_such_module.f"]
    assert stale_tuning_in_text(text) == ["DELETED_FLAG"]
    assert stale_paths(page, text) == ["docs/no-such-page.md", "missing.md"]
    code = "import tncompile\ntncompile.tuning.GONE = 1\nwith tuning.override(ALSO_GONE=0, GROUP_FACTORS=False): pass\n"
    assert stale_tuning_in_code(code) == ["ALSO_GONE", "GONE"]


# ------------------------------------------------------------------ the tree
def package_folders() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def readme_of(folder: Path) -> Path | None:
    """The README that lists ``folder``'s modules: its own, else the nearest above it
    inside the package's top folders."""
    for candidate in (folder, *folder.parents):
        if candidate == PACKAGE:
            return None
        if (candidate / "README.md").exists():
            return candidate / "README.md"
    return None


def unlisted_modules(readme: Path) -> list[str]:
    """Modules under ``readme``'s folder (not under a deeper README) that it does not name
    in a code span, as ``name.py``, a path ending in it, or its bare module name."""
    tokens = set()
    for code in backticked(readme.read_text()):
        tokens.update(re.findall(r"[\w/]+\.py|\w+", code))
    folder, missing = readme.parent, []
    for path in sorted(folder.rglob("*.py")):
        if path.name == "__init__.py" or readme_of(path.parent) != readme:
            continue
        rel = path.relative_to(folder)
        if not {path.name, str(rel), path.stem} & tokens:
            missing.append(str(rel))
    return missing


def missing_listed_files(readme: Path) -> list[str]:
    """``*.py`` names a README gives that exist nowhere: a path from its folder, the package
    or the repository, or a bare name of a file somewhere in the package, benchmarks or tests."""
    folder = readme.parent
    named = {m for code in backticked(readme.read_text()) for m in re.findall(r"(?<![\w/.])([\w/]+\.py)\b", code)}
    everywhere = {p.name for top in (PACKAGE, ROOT / "benchmarks", ROOT / "tests", ROOT / "examples")
                  for p in top.rglob("*.py")}
    return sorted(n for n in named if not any((r / n).exists() for r in (folder, PACKAGE, ROOT))
                  and ("/" in n or n not in everywhere))


@pytest.mark.parametrize("folder", package_folders(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_is_listed_in_its_folders_readme(folder):
    """A newcomer finds a concept from the tree: each folder's README names each of its
    modules (and no file that is gone)."""
    readme = readme_of(folder)
    assert readme is not None, f"tncompile/{folder.relative_to(PACKAGE)} has no README.md listing its modules"
    assert unlisted_modules(readme) == [], f"{readme.relative_to(ROOT)} does not name these modules"
    assert missing_listed_files(readme) == [], f"{readme.relative_to(ROOT)} names files that are gone"


def test_architecture_names_every_folder_and_top_module():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    top = [p.parent.name + "/" for p in PACKAGE.glob("*/__init__.py")]
    modules = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert [name for name in top + modules if name not in text] == []
    on_disk = [prefix for _, prefixes in LAYERS for prefix in prefixes
               if (ROOT / f"{prefix.replace('.', '/')}.py").exists() or (ROOT / prefix.replace(".", "/")).is_dir()]
    assert on_disk == [prefix for _, prefixes in LAYERS for prefix in prefixes], "a layer names a module that is gone"


def upward_registrations() -> set[tuple[str, str]]:
    """``(function, importer)``: each ``register*`` / ``set_planner`` function of a layer
    that a module of a higher layer imports -- where an upper layer registers into a lower one."""
    defined: dict[str, str] = {}
    for path in sources():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and (node.name.startswith("register") or node.name == "set_planner"):
                defined.setdefault(node.name, module_name(path))
    found = set()
    for path in sources():
        module = module_name(path)
        folder = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            for target in imported(module, path, node):
                for alias in node.names:
                    home = defined.get(alias.name)
                    if home is None or target != home:
                        continue
                    home_folder = home.rsplit(".", 1)[0]
                    related = (folder == home_folder or folder.startswith(home_folder + ".")
                               or home_folder.startswith(folder + "."))
                    if not related:
                        found.add((alias.name, module))
    return found


def test_architecture_lists_every_place_an_upper_layer_registers_into_a_lower_one():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Where an upper layer registers into a lower one", 1)
    assert len(section) == 2, "ARCHITECTURE.md lost its registrations section"
    body = section[1].split("\n## ", 1)[0]
    found = upward_registrations()
    assert found, "the scan found no registration at all: it is broken"
    rows = [line for line in body.splitlines() if line.startswith("|")]

    def listed(fn: str, module: str) -> bool:
        path = module.split(".", 1)[1].replace(".", "/") + ".py"
        return any(f"`{fn}`" in row and f"`{path}`" in row for row in rows)
    missing = sorted(f"{fn} (imported by {module})" for fn, module in found if not listed(fn, module))
    assert missing == []
