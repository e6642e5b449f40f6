"""Tiny PyTorch Lightning DDP job (CPU, 2 devices): 4 SGD steps of a 4->1 linear model.

Each rank writes what Lightning saw (its cluster environment, ranks, world size), the final
weights and its environment to ``$DUMP_DIR/<RANK>.json``, the dump_env.py format.
"""

import json
import os
import sys

PRELOADED = "pytorch_lightning" in sys.modules  # forked by fastrun's zygote, imports done

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=4, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
model = Linear()
trainer.fit(model, DataLoader(data, batch_size=8))
env = trainer.strategy.cluster_environment
out = {
    "env": dict(os.environ), "preloaded": PRELOADED,
    "cluster_environment": type(env).__name__,
    "creates_processes_externally": env.creates_processes_externally,
    "global_rank": trainer.global_rank, "local_rank": trainer.local_rank,
    "node_rank": trainer.node_rank, "world_size": trainer.world_size,
    "global_step": trainer.global_step, "backend": dist.get_backend(),
    "weight": model.layer.weight.detach().tolist(), "bias": model.layer.bias.item(),
}
dist.destroy_process_group()  # gloo at interpreter exit without it: std::terminate at times
tmp = os.path.join(os.environ["DUMP_DIR"], f".{out['global_rank']}.tmp")
with open(tmp, "w") as f:
    json.dump(out, f)
os.replace(tmp, os.path.join(os.environ["DUMP_DIR"], f"{out['global_rank']}.json"))
