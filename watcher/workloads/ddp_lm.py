"""Reference workload: a tiny decoder-only language model trained with DDP over gloo.

Watcher's tests and benchmarks need a real distributed training job that is
small enough for a 2-core CPU box, fast to start, and bit-for-bit
reproducible, so a recording or replay can be checked against a known result
and the step-time overhead of recording can be measured.

    torchrun --standalone --nproc_per_node=2 -m watcher.workloads.ddp_lm --steps 50
    python -m watcher.workloads.ddp_lm --steps 50      # single process, no process group

The data is a synthetic corpus from a seeded noisy Markov chain, so nothing is
downloaded and the loss has something learnable to go down towards.
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from watcher.workloads.teardown import end_process_group

VOCAB = 256
SEQ_LEN = 64
D_MODEL = 96
N_HEADS = 4
N_LAYERS = 2
BATCH = 8  # per rank
N_SEQS = 2048  # whole corpus; sharded across ranks by the sampler


def make_corpus(seed: int) -> torch.Tensor:
    """Sequences of SEQ_LEN + 1 tokens from a noisy Markov chain.

    Each token has 4 likely successors; 10% of steps jump uniformly so the
    chain never gets stuck and the task is not trivially memorised.
    """
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, VOCAB, size=(VOCAB, 4))
    seqs = np.empty((N_SEQS, SEQ_LEN + 1), dtype=np.int64)
    seqs[:, 0] = rng.integers(0, VOCAB, size=N_SEQS)
    for t in range(1, SEQ_LEN + 1):
        follow = successors[seqs[:, t - 1], rng.integers(0, 4, size=N_SEQS)]
        noise = rng.integers(0, VOCAB, size=N_SEQS)
        seqs[:, t] = np.where(rng.random(N_SEQS) < 0.1, noise, follow)
    return torch.from_numpy(seqs)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ_LEN, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList(Block(D_MODEL, N_HEADS) for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        # Per-token loss weights (a loss mask, as padded corpora carry): the
        # batch's one floating-point field, where corrupt data shows as NaN.
        per_token = F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1), reduction="none")
        return (per_token * w.reshape(-1)).sum() / w.sum()


def param_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer steps to run")
    p.add_argument("--seed", type=int, default=0, help="seeds weights, corpus and data order")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--batch", type=int, default=BATCH,
                   help="sequences per rank per step (more: longer steps, the same model and collectives)")
    p.add_argument("--save", metavar="PATH", help="rank 0 saves state_dict here and its sha256 to PATH.sha256")
    p.add_argument("--log-every", type=int, default=0, metavar="N", help="print loss every N steps on rank 0")
    p.add_argument("--step-times", metavar="PATH", help="append per-step wall times (ns) as JSON lines to PATH.rank<r>")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint-restart baseline: resume from DIR/ckpt.pt if it exists, and save there "
                        "every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N")
    p.add_argument("--fail-at", type=int, metavar="STEP",
                   help="checkpoint-restart baseline: rank --fail-rank exits 1 at the end of STEP, as a job "
                        "that detects a NaN and aborts would (the time goes to DIR/failed_at)")
    p.add_argument("--fail-rank", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not 1 <= args.batch <= N_SEQS // world_size:
        print(f"ddp_lm: --batch must be 1..{N_SEQS // world_size} with {world_size} rank(s) "
              f"(a corpus of {N_SEQS} sequences)", file=sys.stderr)
        return 2
    # One thread per rank by default so two ranks share two cores without
    # oversubscription skewing step times.
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    # Plain `python -m` leaves WORLD_SIZE unset: run alone, no process group,
    # so nothing waits on a rendezvous that will never come.
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1

    # Same seed on every rank: DDP broadcasts rank 0's weights anyway, but
    # identical corpora are what make the shards disjoint slices of one set.
    torch.manual_seed(args.seed)
    model = TinyLM()
    data = make_corpus(args.seed)
    dataset = TensorDataset(data[:, :-1], data[:, 1:], torch.ones(N_SEQS, SEQ_LEN))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)

    ddp_model = DDP(model) if distributed else model
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3, weight_decay=0.01)

    # Line-buffered, so a benchmark can follow the steps while the job runs.
    times = open(f"{args.step_times}.rank{rank}", "a", buffering=1) if args.step_times else None
    step = 0
    ckpt = os.path.join(args.checkpoint, "ckpt.pt") if args.checkpoint else None
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step = state["step"]
    skip = step % max(len(loader), 1)  # batches of the resumed epoch already trained on
    for epoch in range(step // max(len(loader), 1), math.ceil(args.steps / max(len(loader), 1))):
        sampler.set_epoch(epoch)
        for x, y, w in loader:
            if skip:
                skip -= 1
                continue
            if step >= args.steps:
                break
            t0 = time.perf_counter_ns()
            optimizer.zero_grad()
            loss = ddp_model(x, y, w)
            loss.backward()
            optimizer.step()
            dt = time.perf_counter_ns() - t0
            if times:
                times.write(json.dumps({"rank": rank, "step": step, "ns": dt,
                                        "end": time.monotonic_ns()}) + "\n")
            if args.log_every and rank == 0 and step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if ckpt and args.fail_at == step and rank == args.fail_rank:
                with open(os.path.join(args.checkpoint, "failed_at"), "w") as f:
                    f.write(str(time.monotonic_ns()))
                os._exit(1)
            step += 1
            if ckpt and step % args.checkpoint_every == 0:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "rng": torch.get_rng_state(), "step": step}, ckpt + ".tmp")
                    os.replace(ckpt + ".tmp", ckpt)
                dist.barrier() if distributed else None  # nobody fails past a checkpoint not yet on disk
    if times:
        times.close()

    if args.save and rank == 0:
        torch.save(model.state_dict(), args.save)
        with open(args.save + ".sha256", "w") as f:
            f.write(param_sha256(model) + "\n")

    if distributed:
        # Keep other ranks alive until rank 0 has written its files, so a
        # launcher seeing all ranks exit can trust the outputs are complete.
        end_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
