"""Train a tiny transformer under FSDP2 with block-Muon, with crash-safe checkpoints and resume.

Runs on CPU with gloo; no download (the tokens are synthetic: each sequence follows a fixed random
permutation of the vocabulary, so the loss falls well below log(vocab)):

    torchrun --nproc_per_node=2 examples/fsdp_train.py --steps 20 --ckpt-dir ckpt
    torchrun --nproc_per_node=2 examples/fsdp_train.py --steps 40 --ckpt-dir ckpt --resume

(``python examples/fsdp_train.py`` runs it as one rank.) Every ``--save-every`` steps and at the
last step the model and optimizer go to ``ckpt/step-XXXXXXXX/`` through ``dobb.checkpoints.save``:
the folder is written as ``step-XXXXXXXX.partial`` and renamed once complete (``COMPLETE.json``
lists every file with its size and checksum), so a run killed at any moment, even inside a save,
resumes with ``--resume`` from the newest complete checkpoint and continues exactly as if it had
not stopped. Layout and errors: docs/distributed.md, "Checkpoints (DCP)".
"""
from __future__ import annotations

import argparse
import math
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dobb
from dobb import checkpoints

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 8  # BATCH: global sequences per step


class Block(nn.Module):
    def __init__(self, d=WIDTH, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of step ``step``'s global batch: a function of the step alone, so a resumed
    run sees the data the uninterrupted run would have seen."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1_000_003 * step)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (BATCH,), generator=gen)
    for t in range(SEQ):
        tokens[:, t + 1] = perm[tokens[:, t]]
    rows = BATCH // world
    return tokens[rank * rows:(rank + 1) * rows]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="train up to this step (counted from 1)")
    parser.add_argument("--ckpt-dir", default="checkpoints", help="root of the step-XXXXXXXX folders")
    parser.add_argument("--resume", action="store_true", help="load the newest complete checkpoint first")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep")
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args(argv)

    if "RANK" not in os.environ:  # plain `python examples/fsdp_train.py`: one rank
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # timeout: a rank that dies or freezes (OOM kill, SIGSTOP, a stuck device) leaves the others
    # waiting in their next collective. Without a timeout that wait lasts torch's default (30
    # minutes for gloo) or forever for a frozen peer; with one, every other rank raises after it and
    # torchrun ends the job, so the run can be restarted with --resume. Keep it above the slowest
    # step or save.
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (and in every restart)

    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Row blocks (axis=0) aligned with FSDP2's Shard(0) rows: each rank orthogonalizes its own
    # shard's blocks, so the optimizer step issues no collective.
    opt = dobb.build_optimizer("block-muon", model, lr=args.lr, weight_decay=0.01, axis=0, blocks=world)

    start = 1
    if args.resume:
        got = checkpoints.load_latest(model, opt, args.ckpt_dir)
        if got is None:
            if rank == 0:
                print(f"no complete checkpoint under {args.ckpt_dir}: starting at step 1", flush=True)
        else:
            start = got.step + 1
            if rank == 0:
                print(f"resumed from {got.path} (step {got.step}, loss {got.extra['loss']:.6f})", flush=True)

    loss_value = math.nan
    if start > args.steps and rank == 0:
        print(f"the checkpoint is at step {start - 1}, not before --steps {args.steps}: nothing to train", flush=True)
    for step in range(start, args.steps + 1):
        tokens = batch(step, rank, world)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_value = mean.item() / world
        if rank == 0:
            print(f"step {step} loss {loss_value!r}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            folder = checkpoints.save(model, opt, args.ckpt_dir, step, extra={"loss": loss_value}, keep=args.keep)
            if rank == 0:
                print(f"saved {folder}", flush=True)
    if rank == 0 and start <= args.steps:
        print(f"done: steps {start}-{args.steps} on {world} rank(s), last loss {loss_value!r}", flush=True)
    # every rank past its last collective before any tears the group down: gloo's threads can abort
    # a process ("terminate called without an active exception") when a peer leaves mid-exchange
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
