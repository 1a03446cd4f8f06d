"""``plot_plan``: the plan as a picture (matplotlib, Agg backend, so it works without a display)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lit_model.plan.closed_form import CATEGORIES

if TYPE_CHECKING:
    from lit_model.plan.report import Plan

COLORS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868", "activations": "#c44e52",
    "logits_loss": "#8172b3", "quantization": "#937860", "kv_cache": "#ccb974", "checkpoint": "#da8bc3",
    "overhead": "#8c8c8c",
}


def plot_plan(plan: "Plan", path: str | Path, unit: float = 1e9) -> Path:
    """Stacked bars of the predicted peak by category for the planned run and each suggestion, with the
    device's memory as a line; written as PNG to ``path`` (returned)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("this run", plan.by_category)]
    bars += [("\n".join(s.flags) or "(no change)", s.by_category) for s in plan.suggestions]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(bars) + 3.5), 5.0))
    positions = range(len(bars))
    bottoms = [0.0] * len(bars)
    for cat in CATEGORIES:
        heights = [cats.get(cat, 0) / unit for _, cats in bars]
        if not any(heights):
            continue
        ax.bar(positions, heights, bottom=bottoms, color=COLORS[cat], label=cat.replace("_", " "), width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if plan.device_memory is not None:
        ax.axhline(plan.device_memory / unit, color="black", linestyle="--", linewidth=1.2)
        ax.text(-0.45, plan.device_memory / unit, f"device memory {plan.device_memory / unit:.1f}", va="bottom",
                ha="left", fontsize=8)
    ax.set_xticks(list(positions))
    ax.set_xticklabels([label for label, _ in bars], fontsize=7)
    ax.set_ylabel("predicted peak per rank (GB)" if unit == 1e9 else "predicted peak per rank")
    title = plan.run.get("model", "")
    ax.set_title(f"{title}: {'fits' if plan.fits else 'does not fit'}", fontsize=10)
    top = max(bottoms + [plan.device_memory / unit if plan.device_memory else 0.0])
    ax.set_ylim(0, top * 1.12)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path
