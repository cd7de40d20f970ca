#!/usr/bin/env python3
"""pytorch_ref: PyTorch on the two recipes traind's benches train, for the ratio issue 3 asks
for (traind at least 1.5x PyTorch's tokens/s on the GPT, 2x its samples/s on the MLP), to be
run next to bench_gpt and bench_mlp in the same `make bench`. Figures only.

  GPT: the reference config of bench_gpt (llm.c's GPT-2: pre-LayerNorm blocks, tanh GELU,
       causal attention as nanoGPT writes it without flash attention, tied embedding and LM
       head; L=4 C=256 NH=4 T=256 B=8 V=256) on the fortunes as bytes, AdamW lr 3e-4,
       betas (0.9, 0.95), weight decay 0.1 on 2-D weights only, global-norm clipping at 1.0.
       Prints ms/step, tokens/s and GFLOP/s by nanoGPT's count, as bench_gpt does.
  MLP: bench_mlp's recipe (784-256-256-10 ReLU, AdamW lr 1e-3 without weight decay, batch
       128, reshuffled each epoch, pixels / 255) on Fashion-MNIST. Prints ms/step and
       samples/s.

Both use torch.set_num_threads(THREADS) and leave the first steps out of the timing, as the C
benches do.

usage: pytorch_ref.py [--gpt-steps N] [--mlp-steps N] [--threads T] [--data GLOB]
                      [--mnist DIR]   (defaults 10, 500, 2, the fortunes,
                                       /usr/share/datasets/fashion-mnist)
"""
import argparse
import glob
import gzip
import math
import os
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

GPT_WARMUP = 3  # steps left out of the timing, as bench_gpt's WARMUP_STEPS
MLP_WARMUP = 10  # as bench_mlp's


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_fcproj = nn.Linear(4 * C, C)

    def attn(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.NH, C // self.NH).transpose(1, 2)  # (B, NH, T, hs)
        k = k.view(B, T, self.NH, C // self.NH).transpose(1, 2)
        v = v.view(B, T, self.NH, C // self.NH).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(mask[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.c_fcproj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, C, NH, T, Vp):
        super().__init__()
        self.wte = nn.Embedding(Vp, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList([Block(C, NH) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.blocks:
            x = b(x, self.mask)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied LM head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def time_steps(step, warmup, steps):
    """Runs warmup + steps steps; returns the ms of each timed one."""
    for _ in range(warmup):
        step()
    ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def bench_gpt(args):
    L, C, NH, T, B, V = 4, 256, 4, 256, 8, 256
    files = sorted(f for f in glob.glob(args.data) if os.path.isfile(f) and not f.endswith(".dat"))
    text = b"".join(open(f, "rb").read() for f in files)
    if len(text) < B * T + 1:
        text = bytes(range(256)) * (B * T // 256 + 2)
    tokens = torch.tensor(list(text[: 4 << 20]), dtype=torch.long)
    torch.manual_seed(1)
    model = GPT(L, C, NH, T, V)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    n_params = sum(p.numel() for p in model.parameters())
    flops = (6.0 * (n_params - T * C) + 12.0 * L * C * T) * B * T  # nanoGPT's count
    pos = [0]

    def step():
        i = pos[0]
        if i + B * T + 1 > len(tokens):
            i = 0
        buf = tokens[i:i + B * T + 1]
        pos[0] = i + B * T
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    ms = time_steps(step, GPT_WARMUP, args.gpt_steps)
    mean = sum(ms) / len(ms)
    print(f"PyTorch {torch.__version__} GPT L={L} C={C} NH={NH} T={T} B={B} V={V} "
          f"({n_params / 1e6:.2f}M parameters), adamw, {torch.get_num_threads()} threads:")
    print(f"  {mean:.1f} ms/step (best {min(ms):.1f}) over {len(ms)} steps, "
          f"{B * T / (mean / 1e3):.0f} tokens/s, {flops / (mean * 1e6):.1f} GFLOP/s")


def read_idx(path):
    with (gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open)(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).view(*dims)


def bench_mlp(args):
    images = read_idx(os.path.join(args.mnist, "train-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(args.mnist, "train-labels-idx1-ubyte.gz")).long()
    images = images.view(images.shape[0], -1)
    N, batch = images.shape[0], 128
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    state = {"order": torch.randperm(N), "pos": 0}

    def step():
        if state["pos"] >= N:
            state["order"], state["pos"] = torch.randperm(N), 0
        idx = state["order"][state["pos"]:state["pos"] + batch]
        state["pos"] += batch
        x = images[idx].float() / 255.0
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), labels[idx])
        loss.backward()
        opt.step()

    ms = time_steps(step, MLP_WARMUP, args.mlp_steps)
    mean = sum(ms) / len(ms)
    print(f"PyTorch {torch.__version__} MLP 784-256-256-10, adamw, batch {batch}, "
          f"{torch.get_num_threads()} threads:")
    print(f"  {mean:.3f} ms/step over {len(ms)} steps, {batch / (mean / 1e3):.0f} samples/s")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpt-steps", type=int, default=10)
    p.add_argument("--mlp-steps", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default="/usr/share/games/fortunes/*")
    p.add_argument("--mnist", default="/usr/share/datasets/fashion-mnist")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.gpt_steps > 0:
        bench_gpt(args)
    if args.mlp_steps > 0:
        if os.path.isdir(args.mnist):
            bench_mlp(args)
        else:
            print(f"MLP: skipped, no {args.mnist}", file=sys.stderr)


if __name__ == "__main__":
    main()
