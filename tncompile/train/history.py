"""``History``: what a rank-adaptive training run did, step by step, and its plot."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..files import write_figure, write_replacing

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
    skipped : list of int
        Steps left undone because their loss or gradients were not finite
        (``RankController(nonfinite="skip")``; parameters and optimizer state unchanged).
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
    skipped: list[int] = field(default_factory=list)

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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "History":
        """The history :meth:`to_dict` gave (a checkpoint's ``extra["history"]``)."""
        names = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or set(data) != names or not all(isinstance(v, list) for v in data.values()):
            raise ValueError(f"not a History's to_dict(): needs exactly the lists {sorted(names)}")
        return cls(**{k: list(v) for k, v in data.items()})

    def save_json(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` as JSON to ``path`` (a temporary file renamed over it)."""
        write_replacing(path, json.dumps(self.to_dict()), mode=None)

    def plot(self, path: str | os.PathLike, title: str | None = None, max_layers: int = 24) -> None:
        """Write :meth:`figure` as a PNG to ``path``."""
        import matplotlib.pyplot as plt

        fig = self.figure(title, max_layers)
        write_figure(fig, path, dpi=110, bbox_inches="tight")
        plt.close(fig)

    def figure(self, title: str | None = None, max_layers: int = 24):
        """A matplotlib figure: per-layer ranks (sum over bonds), model ratio, step time and loss over steps.

        Every layer's colour is in a legend beside the plots (the first
        ``max_layers`` layers are drawn); the stage switch (dashed) and the rank
        truncations (dotted) are vertical lines, named in the legend of the
        size panel. The step-time median rolls over a window that fits the run.
        """
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D

        if not self.step:
            raise ValueError("nothing to plot: the history is empty")
        fig, (ax_r, ax_s, ax_t, ax_l) = plt.subplots(4, 1, figsize=(12, 12), sharex=True)
        layers = list(self.ranks[0][1]) if self.ranks else []
        drawn = layers[:max_layers]
        steps = [s for s, _ in self.ranks]
        cmap = plt.get_cmap("tab20" if len(drawn) <= 20 else "viridis")
        for i, name in enumerate(drawn):
            totals = [sum(r[name]) if name in r else 0 for _, r in self.ranks]
            colour = cmap(i % 20) if len(drawn) <= 20 else cmap(i / max(1, len(drawn) - 1))
            ax_r.plot(steps, totals, drawstyle="steps-post", color=colour, lw=1, label=name)
        ax_r.set_ylabel("rank (sum over bonds)")
        ax_r.set_title(title or "rank evolution")
        if drawn:
            heading = f"layers (first {max_layers} of {len(layers)})" if len(layers) > max_layers else "layers"
            ax_r.legend(fontsize=6, title=heading, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                        ncol=1 if len(drawn) <= 12 else 2, frameon=False)
        ax_s.plot(self.step, self.ratio, color="tab:blue", label="model ratio")
        ax_s.set_yscale("log")
        ax_s.set_ylabel("model ratio (params / dense)")
        marks = [Line2D([], [], color="tab:blue", label="model ratio")]
        kinds = {ev["kind"] for ev in self.events}
        if "late_stage" in kinds:
            marks.append(Line2D([], [], color="k", ls="--", label="late stage begins"))
        if kinds - {"late_stage"}:
            marks.append(Line2D([], [], color="tab:orange", ls=":", label="ranks cut"))
        ax_s.legend(handles=marks, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        width = _median_window(len(self.step_ms))
        median = _rolling_median(self.step_ms, width)
        ax_t.plot(self.step, self.step_ms, color="tab:gray", lw=0.4, alpha=0.5, label="step")
        ax_t.plot(self.step, median, color="tab:green", label=f"rolling median ({width} steps)")
        ax_t.set_ylabel("step time (ms)")
        ax_t.set_ylim(0, 1.5 * max(median))
        ax_t.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        ax_l.plot(self.step, self.task_loss, color="tab:gray", lw=0.5, alpha=0.6, label="task loss")
        ax_l.plot(self.step, _smooth(self.task_loss), color="tab:red", label="task loss (smoothed)")
        handles, labels = ax_l.get_legend_handles_labels()
        if self.evals:
            ax_e = ax_l.twinx()
            for k in self.evals[0][1]:
                ax_e.plot([s for s, e in self.evals], [e[k] for _, e in self.evals], "o-", ms=3, label=f"eval: {k}")
            ax_e.set_ylabel("eval")
            more_handles, more_labels = ax_e.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        ax_l.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.08 if self.evals else 1.01, 1.0),
                    frameon=False)
        ax_l.set_ylabel("loss")
        ax_l.set_xlabel("step")
        for ev in self.events:
            style = {"color": "k", "ls": "--"} if ev["kind"] == "late_stage" else {"color": "tab:orange", "ls": ":", "lw": 0.6}
            for ax in (ax_r, ax_s, ax_t, ax_l):
                ax.axvline(ev["step"], **style)
        fig.tight_layout()
        return fig


def _median_window(count: int, widest: int = 51) -> int:
    """An odd window about a tenth of the run (3 at least, ``widest`` at most):
    a 51-step window over a 24-step run would draw one flat line."""
    width = max(3, min(widest, count // 10))
    return width if width % 2 else width + 1


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
