"""The picture of ``mtc demo``: training through its faults, each recovery with the tiers it read.

Recoveries are drawn narrow (a quarter of the width between them, their duration written beside
them), so the picture shows the training, not the waiting. Every mark is in the legend or the
caption; labels are placed where they cover no other label and no training step (``_place``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TIER_COLOR = {"ram": "tab:green", "peer": "tab:blue", "backup": "tab:purple"}
STALL_S = 0.5  # a pause longer than this before the first step after a recovery is drawn (compiling)


def _squeeze(recoveries: list, width: float):
    """Map run time to the picture's x: each recovery takes ``width`` seconds of it, whatever it
    lasted (its duration is written on it), so training, not waiting, fills the picture."""
    spans = sorted((t0, t1) for t0, t1, *_ in recoveries)

    def x(t: float) -> float:
        out = t
        for t0, t1 in spans:
            if t >= t1:
                out -= (t1 - t0) - width
            elif t > t0:
                out -= (t - t0) * (1 - width / (t1 - t0))
        return out

    return x


def stalls(tl: Any) -> list[tuple[float, float]]:
    """(end of a recovery, its first step) where that pause is longer than ``STALL_S`` or five of the run's
    usual steps: the train step compiled again (a new mesh after a slice came or went), when no step is drawn."""
    times = sorted(t for t, _, _ in tl.steps)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    usual = gaps[len(gaps) // 2] if gaps else STALL_S
    out = []
    for _, t1, *_ in tl.recoveries:
        after = [t for t in times if t > t1]
        if after and min(after) - t1 > min(STALL_S, 5 * usual):
            out.append((t1, min(after)))
    return out


def _at_step(tl: Any, t: float, step: int) -> float:
    """When ``step`` was trained last before ``t`` (a backup is drawn on the step it holds, not when it ended)."""
    when = [ts for ts, s, _ in tl.steps if s == step and ts <= t]
    return max(when) if when else t


def _place(ax: Any, fig: Any, text: Any, tries: list[tuple[float, float]], avoid: list, points: Any) -> None:
    """Move ``text`` (an annotation, offset in points) to the first offset of ``tries`` where its box
    overlaps none of ``avoid`` (boxes already placed) and no point of ``points`` (display coordinates),
    then add its box to ``avoid``. The last try is kept when none is free."""
    renderer = fig.canvas.get_renderer()
    for dx, dy in tries:
        text.set_position((dx, dy))
        box = text.get_window_extent(renderer).expanded(1.05, 1.15)
        if any(box.overlaps(b) for b in avoid):
            continue
        if points is not None and len(points) and (
                (points[:, 0] >= box.x0) & (points[:, 0] <= box.x1)
                & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1)).any():
            continue
        break
    avoid.append(text.get_window_extent(renderer))


def plot(tl: Any, path: Path, steps: int, fault_names: dict, backup_every: int | None = None) -> tuple:
    """The demo's timeline (``demo.Timeline``) as a PNG at ``path``; returns what the labels are, where they
    were drawn and where the training steps were (display coordinates: what the test checks for overlaps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    # Recoveries take a quarter of the picture between them, training the rest.
    run_s = max([t for t, _, _ in tl.steps] + [t1 for _, t1, *_ in tl.recoveries], default=1.0)
    training_s = max(run_s - sum(t1 - t0 for t0, t1, *_ in tl.recoveries), 1e-3)
    width = training_s / 3 / max(1, len(tl.recoveries))
    x = _squeeze(tl.recoveries, width)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    ax.set_ylim(0, steps * 1.35)  # room above the run for the faults' names
    right = max([x(t) for t, _, _ in tl.steps] + [x(t1) for _, t1, *_ in tl.recoveries], default=1.0)
    ax.set_xlim(-0.02 * right, right * 1.12)
    if tl.steps:
        ax.plot([x(t) for t, _, _ in tl.steps], [s for _, s, _ in tl.steps], ".", color="0.4", ms=3,
                label="train step")
        one = [(x(t), s) for t, s, n in tl.steps if n == 1]
        if one:
            ax.plot(*zip(*one), ".", color="tab:orange", ms=4, label="train step on one slice")
    if tl.saves:
        ax.plot([x(t) for t, _ in tl.saves], [s for _, s in tl.saves], "o", mfc="none", color="0.55", ms=5,
                label="local checkpoint")
    if tl.backups:
        every = f" (every {backup_every} steps, the first at once)" if backup_every else ""
        ax.plot([x(_at_step(tl, t, s)) for t, s in tl.backups], [s for _, s in tl.backups], "s", mfc="none",
                color="tab:purple", ms=9, label=f"step backed up{every}")
    for i, (t0, t1) in enumerate(stalls(tl)):
        ax.axvspan(x(t0), x(t1), color="0.85", alpha=0.6, hatch="//", lw=0,
                   label="first step after a recovery: the train step compiles" if i == 0 else None)
    ax.plot([], [], "-", color="tab:red", lw=1, label="fault")
    for tier, color in TIER_COLOR.items():
        ax.plot([], [], "*", color=color, ms=10, label=f"restored, farthest tier {tier} (shaded: the recovery)")
    ax.set_xlabel("seconds of training (each recovery drawn narrow, its duration written beside it)")
    ax.set_ylabel("step")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=3, frameon=False)
    ax.set_title("mtc demo: training through five faults, and the tier each recovery read from")
    fig.tight_layout()  # before the labels are placed: the layout moves the axes
    fig.canvas.draw()
    points = ax.transData.transform(np.array([(x(t), s) for t, s, _ in tl.steps])) if tl.steps else None
    placed: list = []
    texts = []
    for t, fault in sorted(tl.faults):
        ax.axvline(x(t), color="tab:red", lw=1)
        label = ax.annotate(fault_names[fault], (x(t), 1.0), xycoords=("data", "axes fraction"),
                            textcoords="offset points", xytext=(-2, -3), rotation=90, va="top", ha="right",
                            fontsize=8, color="tab:red")
        _place(ax, fig, label, [(-2, -3), (11, -3), (-2, -60), (11, -60), (-2, -120), (11, -120)], placed, points)
        texts.append(label)
    for t0, t1, step, tiers in tl.recoveries:
        tier = (tiers or ["ram"])[-1]  # the farthest tier it needed
        ax.axvspan(x(t0), x(t1), color=TIER_COLOR[tier], alpha=0.2)
        ax.plot([x(t1)], [step], "*", color=TIER_COLOR[tier], ms=13)
        label = ax.annotate(f"step {step} from {' + '.join(tiers) or 'ram'}\n{t1 - t0:.1f} s", (x(t1), step),
                            textcoords="offset points", xytext=(8, -26), fontsize=8, color=TIER_COLOR[tier],
                            arrowprops=dict(arrowstyle="-", color=TIER_COLOR[tier], lw=0.6, shrinkA=0, shrinkB=4))
        tries = [(8, -26), (8, -48), (-70, -26), (-70, -48), (8, -70), (-70, -70), (8, 14), (-70, 14), (8, -92)]
        _place(ax, fig, label, tries, placed, points)
        texts.append(label)
    fig.savefig(path, dpi=110)
    renderer = fig.canvas.get_renderer()
    drawn = ([t.get_text() for t in texts], [t.get_window_extent(renderer) for t in texts],
             ax.transData.transform(np.array([(x(t), s) for t, s, _ in tl.steps])) if tl.steps else np.zeros((0, 2)))
    plt.close(fig)
    return drawn
