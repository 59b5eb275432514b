"""A PyTorch Lightning job: Trainer(accelerator="cpu", strategy="ddp", devices=2), gloo.

Nothing in it knows about Watcher.  Rank 0 writes the sha256 of the final
parameters to --save, so a run under `watcher run` can be compared bit for bit
with a plain run.  Each rank also appends a line per step to a log file it
keeps open, like a metrics logger would (a replay must not write to it).
"""

import argparse
import hashlib
import os

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self, lr: float, log_path: str | None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
        self.lr = lr
        self.log_path = log_path
        self.log_file = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.log_path:
            if self.log_file is None:
                self.log_file = open(f"{self.log_path}.rank{self.global_rank}", "a", buffering=1)
            self.log_file.write(f"step {self.global_step} loss {loss.item():.6f}\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save", required=True)
    p.add_argument("--log", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, workers=True, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(4096, 1, generator=g))
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=g)
    model = Regressor(lr=0.01, log_path=args.log)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, deterministic=True,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        h = hashlib.sha256()
        for _, t in sorted(model.state_dict().items()):
            h.update(t.detach().contiguous().numpy().tobytes())
        with open(args.save, "w") as f:
            f.write(h.hexdigest() + "\n")


if __name__ == "__main__":
    main()
