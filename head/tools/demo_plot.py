"""The picture of ``mtc demo``: training through its faults, each recovery with the tiers it read.

Recoveries are drawn narrow (a quarter of the width between them, their duration written beside
them), so the picture shows the training, not the waiting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TIER_COLOR = {"ram": "tab:green", "peer": "tab:blue", "backup": "tab:purple"}


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


def plot(tl: Any, path: Path, steps: int, fault_names: dict) -> None:
    """The demo's timeline (``demo.Timeline``) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    # Recoveries take a quarter of the picture between them, training the rest.
    run_s = max([t for t, _, _ in tl.steps] + [t1 for _, t1, *_ in tl.recoveries], default=1.0)
    training_s = max(run_s - sum(t1 - t0 for t0, t1, *_ in tl.recoveries), 1e-3)
    width = training_s / 3 / max(1, len(tl.recoveries))
    x = _squeeze(tl.recoveries, width)
    fig, ax = plt.subplots(figsize=(11, 5))
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
        ax.plot([x(t) for t, _ in tl.backups], [s for _, s in tl.backups], "s", mfc="none", color="tab:purple",
                ms=9, label="backup")
    for t, fault in tl.faults:
        ax.axvline(x(t), color="tab:red", lw=1)
        ax.text(x(t), steps * 1.02, fault_names[fault], rotation=90, va="top", ha="right", fontsize=8,
                color="tab:red")
    for t0, t1, step, tiers in tl.recoveries:
        tier = (tiers or ["ram"])[-1]  # the farthest tier it needed
        ax.axvspan(x(t0), x(t1), color=TIER_COLOR[tier], alpha=0.2)
        ax.plot([x(t1)], [step], "*", color=TIER_COLOR[tier], ms=13)
        ax.annotate(f"step {step} from {' + '.join(tiers) or 'ram'}\n{t1 - t0:.1f} s", (x(t1), step),
                    textcoords="offset points", xytext=(6, -18), fontsize=8, color=TIER_COLOR[tier])
    for tier, color in TIER_COLOR.items():
        ax.plot([], [], "*", color=color, ms=10, label=f"restored, farthest tier {tier}")
    ax.set_xlabel("seconds of training (each recovery drawn narrow, its duration written beside it)")
    ax.set_ylabel("step")
    ax.set_ylim(0, steps * 1.05)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, ncol=7, frameon=False)
    ax.set_title("mtc demo: training through five faults, and the tier each recovery read from")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
