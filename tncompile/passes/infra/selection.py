"""PEFT-style module selection: ``"all"``, name suffixes, or ``"re:<regex>"``."""
from __future__ import annotations

import re
from typing import Iterable, Sequence

__all__ = ["entries", "matches", "select_modules", "pattern_lookup", "check_entry", "check_pattern_keys"]


def entries(spec: str | Sequence[str] | None, argument: str) -> list[str]:
    """``target_modules`` / ``exclude_modules`` as a list of entries (``TypeError`` naming ``argument``)."""
    if spec is None:
        return []
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, (list, tuple, set, frozenset)) and all(isinstance(s, str) for s in spec):
        return list(spec)
    raise TypeError(f"{argument} must be 'all', a list of module-name suffixes or 're:<regex>', "
                    f"got {spec!r}")


def matches(name: str, entry: str) -> bool:
    """``entry`` is ``"all"``, ``"re:<regex>"`` (full match) or a dotted-name suffix."""
    if entry == "all":
        return True
    if entry.startswith("re:"):
        return re.fullmatch(entry[3:], name) is not None
    return name == entry or name.endswith("." + entry)


def select_modules(names: Iterable[str], target: str | Sequence[str] | None,
                   exclude: str | Sequence[str] | None) -> tuple[set[str], set[str]]:
    """Split ``names`` into (selected, excluded-by-``exclude``).

    Raises ``ValueError`` for an entry of ``target_modules`` or
    ``exclude_modules`` that matches no compressible module.
    """
    names = list(names)
    targets = entries(target, "target_modules") or ["all"]
    excludes = entries(exclude, "exclude_modules")
    for argument, given in (("target_modules", targets), ("exclude_modules", excludes)):
        for e in given:
            check_entry(e, argument, names)
    chosen = {n for n in names if any(matches(n, e) for e in targets)}
    excluded = {n for n in chosen if any(matches(n, e) for e in excludes)}
    return chosen - excluded, excluded


def check_entry(entry: str, argument: str, names: Sequence[str] | None = None,
                what: str = "compressible module") -> None:
    """Raise ``ValueError`` if ``entry`` is a bad ``re:`` regex or (given
    ``names``) matches none of them."""
    if entry.startswith("re:"):
        try:
            re.compile(entry[3:])
        except re.error as err:
            raise ValueError(f"{argument} entry {entry!r} is not a valid regex: {err}") from err
    if names is not None and not any(matches(n, entry) for n in names):
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(f"{argument} entry {entry!r} matches no {what}; {what}s are: {shown}")


def check_pattern_keys(names: Iterable[str], pattern: dict[str, int] | None, argument: str) -> None:
    """Every key of ``pattern`` must match one of ``names`` (a key that matches
    nothing is a typo that would otherwise be silently ignored)."""
    names = sorted(names)
    for key in pattern or {}:
        check_entry(key, argument, names, what="tensorized layer")


def pattern_lookup(name: str, pattern: dict[str, int] | None) -> int | None:
    """Value of the first ``pattern`` key matching ``name`` (exact names win)."""
    if not pattern:
        return None
    if name in pattern:
        return pattern[name]
    for key, value in pattern.items():
        if matches(name, key):
            return value
    return None
