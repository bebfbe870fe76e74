"""``History``: what a rank-adaptive training run did, step by step, and its plot."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["History"]


@dataclass
class History:
    """Per-step records of :func:`tncompile.fit`.

    Attributes
    ----------
    step, loss, task_loss, ratio, step_ms, stage : lists, one entry per step
        ``loss`` is what was minimized (task loss plus the stage's penalty);
        ``ratio`` the model's true size after the step.
    ranks : list of (step, {layer: ranks})
        Switched-on ranks (``|g| >= threshold``) of every layer, logged every
        ``log_every`` steps and after every truncation.
    events : list of dict
        Stage switches and truncations (``{"step", "kind", ...}``).
    evals : list of (step, {metric: value})
        What ``eval_fn`` returned.
    """

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    task_loss: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    stage: list[str] = field(default_factory=list)
    ranks: list[tuple[int, dict[str, list[int]]]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def record(self, step: int, loss: float, task_loss: float, ratio: float, step_ms: float, stage: str) -> None:
        self.step.append(step)
        self.loss.append(loss)
        self.task_loss.append(task_loss)
        self.ratio.append(ratio)
        self.step_ms.append(step_ms)
        self.stage.append(stage)

    def __len__(self) -> int:
        return len(self.step)

    def median_step_ms(self, start: int | None = None, stop: int | None = None) -> float:
        """Median step time over steps ``start <= step < stop``."""
        times = sorted(t for s, t in zip(self.step, self.step_ms)
                       if (start is None or s >= start) and (stop is None or s < stop))
        if not times:
            raise ValueError(f"no steps recorded in [{start}, {stop})")
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    def plot(self, path: str | os.PathLike, title: str | None = None, max_layers: int = 24) -> None:
        """Write a PNG: per-layer ranks (sum over bonds), model ratio, step time and loss over steps.

        Stage switches and truncations are marked with vertical lines.
        """
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not self.step:
            raise ValueError("nothing to plot: the history is empty")
        fig, (ax_r, ax_s, ax_t, ax_l) = plt.subplots(4, 1, figsize=(9, 12), sharex=True)
        layers = list(self.ranks[0][1]) if self.ranks else []
        steps = [s for s, _ in self.ranks]
        cmap = plt.get_cmap("viridis")
        for i, name in enumerate(layers[:max_layers]):
            totals = [sum(r[name]) if name in r else 0 for _, r in self.ranks]
            ax_r.plot(steps, totals, drawstyle="steps-post", color=cmap(i / max(1, min(len(layers), max_layers) - 1)), lw=1,
                      label=name if len(layers) <= 12 else None)
        ax_r.set_ylabel("rank (sum over bonds)")
        ax_r.set_title(title or "rank evolution")
        if 0 < len(layers) <= 12:
            ax_r.legend(fontsize=6, ncol=2)
        elif len(layers) > max_layers:
            ax_r.text(0.99, 0.95, f"first {max_layers} of {len(layers)} layers", ha="right", va="top",
                      transform=ax_r.transAxes, fontsize=8)
        ax_s.plot(self.step, self.ratio, color="tab:blue")
        ax_s.set_yscale("log")
        ax_s.set_ylabel("model ratio (params / dense)")
        ax_t.plot(self.step, self.step_ms, color="tab:gray", lw=0.4, alpha=0.5, label="step")
        ax_t.plot(self.step, _rolling_median(self.step_ms), color="tab:green", label="rolling median (51 steps)")
        ax_t.set_ylabel("step time (ms)")
        ax_t.set_ylim(0, 1.5 * max(_rolling_median(self.step_ms)))
        ax_t.legend(fontsize=7)
        ax_l.plot(self.step, self.task_loss, color="tab:gray", lw=0.5, alpha=0.6, label="task loss")
        ax_l.plot(self.step, _smooth(self.task_loss), color="tab:red", label="task loss (smoothed)")
        if self.evals:
            ax_e = ax_l.twinx()
            for k in self.evals[0][1]:
                ax_e.plot([s for s, e in self.evals], [e[k] for _, e in self.evals], "o-", ms=3, label=k)
            ax_e.set_ylabel("eval")
            ax_e.legend(fontsize=7, loc="upper center")
        ax_l.set_ylabel("loss")
        ax_l.set_xlabel("step")
        ax_l.legend(fontsize=7)
        for ev in self.events:
            style = {"color": "k", "ls": "--"} if ev["kind"] == "late_stage" else {"color": "tab:orange", "ls": ":", "lw": 0.6}
            for ax in (ax_r, ax_s, ax_t, ax_l):
                ax.axvline(ev["step"], **style)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _rolling_median(values: list[float], width: int = 51) -> list[float]:
    half = width // 2
    out = []
    for i in range(len(values)):
        window = sorted(values[max(0, i - half): i + half + 1])
        out.append(window[len(window) // 2])
    return out


def _smooth(values: list[float], beta: float = 0.95) -> list[float]:
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i))
    return out
