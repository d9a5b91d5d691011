"""The one place figures are made and written, so every report plot looks and saves the same."""

from __future__ import annotations

from pathlib import Path


def figure(ncols: int = 1, size: tuple[float, float] = (9.0, 3.5)):
    """A (figure, axes) pair on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size)


def save(fig, path: Path, title: str | None = None) -> Path:
    """Title, tighten, write as PNG and release the figure's memory."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
