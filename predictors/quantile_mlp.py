"""The network behind `neural-length`: an MLP with one output per quantile, and its Lightning
training wrapper.

The network is plain torch (`QuantileNet`), so serving loads it without importing Lightning
(~7 s on a cold 2-core machine); `QuantileRegression` is the LightningModule that trains it with
the pinball loss. Outputs never cross: the head predicts the lowest quantile and non-negative
(softplus) steps up to each next one, so q_0.5 <= q_0.9 <= q_0.95 holds for every input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class QuantileNet(nn.Module):
    """inputs -> hidden -> hidden -> one value per quantile (ascending)."""

    def __init__(self, inputs: int, hidden: int, quantiles: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(inputs, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, quantiles),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raw = self.body(x)
        steps = nn.functional.softplus(raw[:, 1:])
        return torch.cat([raw[:, :1], raw[:, :1] + torch.cumsum(steps, dim=1)], dim=1)


def pinball_loss(prediction: torch.Tensor, target: torch.Tensor, quantiles: torch.Tensor) -> torch.Tensor:
    """Mean over rows and quantiles of max(q (y - p), (q - 1) (y - p)): minimised by the q-th
    conditional quantile of y, which is what each output column learns."""
    error = target.unsqueeze(1) - prediction
    return torch.mean(torch.maximum(quantiles * error, (quantiles - 1.0) * error))


def _lightning_module():
    """Defined on first use so that importing this module does not import Lightning."""
    import lightning.pytorch as pl

    class QuantileRegression(pl.LightningModule):
        """Trains a QuantileNet with the pinball loss and AdamW; logs `train_pinball` and
        `val_pinball` per epoch to whatever logger the Trainer has (MLflow in the pipeline)."""

        def __init__(
            self, net: QuantileNet, quantiles: Sequence[float], learning_rate: float, weight_decay: float
        ) -> None:
            super().__init__()
            self.net = net
            self.register_buffer("quantiles", torch.tensor(list(quantiles), dtype=torch.float32))
            self.learning_rate = learning_rate
            self.weight_decay = weight_decay

        def training_step(self, batch, _index):
            x, y = batch
            loss = pinball_loss(self.net(x), y, self.quantiles)
            self.log("train_pinball", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch, _index):
            x, y = batch
            self.log("val_pinball", pinball_loss(self.net(x), y, self.quantiles), on_epoch=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)

    return QuantileRegression


def train_quantile_net(
    net: QuantileNet,
    train: tuple[torch.Tensor, torch.Tensor],
    validation: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    quantiles: Sequence[float],
    epochs: int,
    batch_size: int,
    learning_rate: float,
    weight_decay: float,
    seed: int,
    logger=None,
) -> QuantileNet:
    """Fit `net` in place with a Lightning Trainer on the CPU (the network is small; the GPU
    belongs to the served model) and return it in eval mode. The global RNG is left untouched."""
    import logging

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" banner
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        loaders = {
            "train_dataloaders": DataLoader(
                TensorDataset(*train), batch_size=batch_size, shuffle=True, generator=generator
            )
        }
        if validation is not None:
            loaders["val_dataloaders"] = DataLoader(TensorDataset(*validation), batch_size=4096)
        module = _lightning_module()(net, quantiles, learning_rate, weight_decay)
        trainer = pl.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            logger=logger if logger is not None else False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,  # losses are logged per epoch; silences a warning on small data
        )
        trainer.fit(module, **loaders)
    return net.eval()
