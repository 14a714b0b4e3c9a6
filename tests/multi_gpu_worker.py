"""One training step of a small model with our modules, on one GPU or data-parallel on several (DDP or FSDP2),
for tests/test_multi_gpu.py. Writes the loss and the parameters after the step (rank 0) to --out.

    python tests/multi_gpu_worker.py --kind single --out one.pt
    python -m torch.distributed.run --nproc_per_node 2 tests/multi_gpu_worker.py --kind ddp --out two.pt
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from ops.layernorm import LayerNorm  # noqa: E402
from ops.layernorm_linear import FusedLayerNormLinear  # noqa: E402

BATCH, SEQ, D = 8, 16, 64


def model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(FusedLayerNormLinear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), LayerNorm(D)).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=("single", "ddp", "fsdp2"), required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if args.kind != "single":
        dist.init_process_group("nccl", device_id=device)
    m = model(device)
    if args.kind == "ddp":
        m = nn.parallel.DistributedDataParallel(m, device_ids=[device.index])
    elif args.kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for sub in m:
            if any(True for _ in sub.parameters()):
                fully_shard(sub)
        fully_shard(m)
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, D, device=device)[rank * BATCH // world:(rank + 1) * BATCH // world]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for n, p in m.named_parameters()}
    if args.kind != "single":
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
    if rank == 0:
        names = {n.removeprefix("module."): t for n, t in params.items()}
        torch.save({"loss": loss.detach().cpu(), "params": names}, args.out)
    if args.kind != "single":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
