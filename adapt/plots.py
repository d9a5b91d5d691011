"""The one place figures are made and written, so every report plot looks and saves the same."""

from __future__ import annotations

from pathlib import Path


def figure(ncols: int = 1, size: tuple[float, float] = (9.0, 3.5)):
    """A (figure, axes) pair on the headless Agg backend, with 20 distinct line colours (the
    default 10 repeat once every policy is on one plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, ncols, figsize=size)
    for ax in np.atleast_1d(axes):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    return fig, axes


def save(fig, path: Path, title: str | None = None) -> Path:
    """Title, tighten, write as PNG and release the figure's memory."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
