"""MovieLens-100k as DLRM's inputs (issue 67's second, independent check).

Each rating is one sample: the dense features are the user's age (over 100) and gender and
the movie's 19 genre flags; the tables are the user, the movie and the user's occupation;
the label is the rating (1-5). ``u1.base`` / ``u1.test`` are the data set's own 80/20 split.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dlrm_model import CriteoRows

GENRES = 19
DENSE_FEATURES = 2 + GENRES


def _lines(path: Path, encoding: str = "latin-1") -> list[list[str]]:
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\n").split("|") for line in f if line.strip()]


def table_sizes(folder: str | Path) -> list[int]:
    """Rows of the user, movie and occupation tables (ids are the files' ids minus one)."""
    folder = Path(folder)
    occupations = [line[0] for line in _lines(folder / "u.occupation")]
    return [len(_lines(folder / "u.user")), len(_lines(folder / "u.item")), len(occupations)]


def read_movielens(folder: str | Path, split: str = "u1") -> tuple[CriteoRows, CriteoRows]:
    """``(train, test)`` of ``split`` (``u1`` .. ``u5``): ``dense`` ``(n, 21)``, ``sparse``
    ``(n, 3)`` (user, movie, occupation ids), ``labels`` ``(n,)`` the ratings. A line that
    is not ``user item rating time`` with ids in range is a ``ValueError`` naming it."""
    folder = Path(folder)
    users = {int(u[0]): u for u in _lines(folder / "u.user")}
    occupations = {name: k for k, name in enumerate(line[0] for line in _lines(folder / "u.occupation"))}
    items = {int(i[0]): [float(g) for g in i[-GENRES:]] for i in _lines(folder / "u.item")}

    def read(name: str) -> CriteoRows:
        dense, sparse, labels = [], [], []
        with open(folder / name, encoding="ascii") as f:
            for number, line in enumerate(f, 1):
                fields = line.split()
                try:
                    user, item, rating = int(fields[0]), int(fields[1]), float(fields[2])
                    _, age, gender, occupation, _ = users[user]
                    genres = items[item]
                    job = occupations[occupation]
                except (ValueError, IndexError, KeyError) as e:
                    raise ValueError(f"{folder / name}:{number}: not a rating of a known user and movie ({e})") from e
                dense.append([int(age) / 100, 1.0 if gender == "F" else 0.0, *genres])
                sparse.append([user - 1, item - 1, job])
                labels.append(rating)
        return CriteoRows(torch.tensor(dense), torch.tensor(sparse, dtype=torch.int64), torch.tensor(labels))

    return read(f"{split}.base"), read(f"{split}.test")
