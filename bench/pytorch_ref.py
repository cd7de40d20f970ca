#!/usr/bin/env python3
"""pytorch_ref: PyTorch on the two recipes traind's benches train, for the ratio issue 3 asks
for (traind at least 1.5x PyTorch's tokens/s on the GPT, 2x its samples/s on the MLP), to be
run next to bench_gpt and bench_mlp in the same `make bench`. Figures only.

  GPT: the reference config of bench_gpt (llm.c's GPT-2: pre-LayerNorm blocks, tanh GELU,
       causal attention as nanoGPT writes it without flash attention, tied embedding and LM
       head; L=4 C=256 NH=4 T=256 B=8 V=256) on the fortunes as bytes, AdamW lr 3e-4,
       betas (0.9, 0.95), weight decay 0.1 on 2-D weights only, global-norm clipping at 1.0.
       Prints ms/step, tokens/s and GFLOP/s by nanoGPT's count, as bench_gpt does.
  sensorlm: bench_sensorlm's presets (tiny: both towers D 64, depth 2, 4 heads, MLP 256, E 64,
       batch 32; small: 256, 6, 4, 1024, E 256, batch 8) as README.md "SensorLM" gives the
       model: a window of T=1440 x C=10 readings normalised per channel (NaN -> 0), cut into
       10x2 patches (N=720 tokens of 20), patch projection plus positions, pre-LayerNorm
       blocks without a mask, the MAP head (a probe's multi-head attention over the tokens,
       then its MLP on the residual), projection and L2 norm; the text tower over 64 byte
       tokens with a causal mask, pooled at the end token; SigLIP's sigmoid loss with the
       learned logit scale and bias; AdamW lr 1e-3, weight decay 0.1 on 2-D tensors. Inputs
       drawn as bench_sensorlm draws them (random walks, 3% NaN). Prints ms/step, samples/s,
       GFLOP/s by bench_sensorlm's count.
  MLP: bench_mlp's recipe (784-256-256-10 ReLU, AdamW lr 1e-3 without weight decay, batch
       128, reshuffled each epoch, pixels / 255) on Fashion-MNIST. Prints ms/step and
       samples/s.

Both use torch.set_num_threads(THREADS), THREADS the machine's cores unless --threads says
otherwise (as bench_gpt uses them all), and leave the first steps out of the timing, as the C
benches do. Run it with OMP_WAIT_POLICY=passive for PyTorch's best settings here (bench/all.sh
does both).

usage: pytorch_ref.py [--gpt-steps N] [--mlp-steps N] [--slm tiny|small|all] [--slm-steps N]
                      [--threads T] [--data GLOB] [--mnist DIR]
       (defaults 10, 500, no sensorlm, the preset's steps (10 tiny, 4 small), the cores, the
        fortunes, /usr/share/datasets/fashion-mnist)
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
    """Runs warmup + steps steps; returns the ms of each timed one. Sets BUSY to the cores the
    process had over the timed steps (its CPU time over their wall time), as the C benches
    print it: well below the cores there are, other work took the rest."""
    global BUSY
    for _ in range(warmup):
        step()
    ms = []
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    BUSY = (time.process_time() - c0) / max(time.perf_counter() - w0, 1e-9)
    return ms


BUSY = 0.0


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
          f"{B * T / (mean / 1e3):.0f} tokens/s, {flops / (mean * 1e6):.1f} GFLOP/s; "
          f"{BUSY:.2f} of {os.cpu_count()} cores busy")


# ---- sensorlm ----------------------------------------------------------------------------

SLM_WARMUP = 2  # as bench_sensorlm's WARMUP_STEPS
# preset: (D, depth, heads, mlp, E, batch, steps), as bench_sensorlm's
SLM_PRESETS = {"tiny": (64, 2, 4, 256, 64, 32, 10), "small": (256, 6, 4, 1024, 256, 8, 4)}


class SlmBlock(nn.Module):
    """A pre-LayerNorm block as README.md's: qkv, attention (causal or not), out, GELU MLP."""

    def __init__(self, D, H, M, causal):
        super().__init__()
        self.H, self.causal = H, causal
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, M)
        self.fc2 = nn.Linear(M, D)

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, N, self.H, D // self.H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // self.H))
        if self.causal:
            mask = torch.ones(N, N, dtype=torch.bool).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, N, D)
        x = x + self.out(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class SensorLM(nn.Module):
    def __init__(self, D, depth, H, M, E, N, P, L):
        super().__init__()
        self.H = H
        self.patch = nn.Linear(P, D)
        self.s_pos = nn.Parameter(torch.randn(N, D) * 0.02)
        self.s_blocks = nn.ModuleList([SlmBlock(D, H, M, False) for _ in range(depth)])
        self.s_ln_f = nn.LayerNorm(D)
        self.probe = nn.Parameter(torch.randn(D) * 0.02)
        self.map_q, self.map_k = nn.Linear(D, D), nn.Linear(D, D)
        self.map_v, self.map_out = nn.Linear(D, D), nn.Linear(D, D)
        self.map_ln = nn.LayerNorm(D)
        self.map_fc1, self.map_fc2 = nn.Linear(D, M), nn.Linear(M, D)
        self.s_proj = nn.Linear(D, E, bias=False)
        self.tok = nn.Embedding(258, D)
        self.t_pos = nn.Parameter(torch.randn(L, D) * 0.02)
        self.t_blocks = nn.ModuleList([SlmBlock(D, H, M, True) for _ in range(depth)])
        self.t_ln_f = nn.LayerNorm(D)
        self.t_proj = nn.Linear(D, E, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0))

    def sensor(self, p):
        h = self.patch(p) + self.s_pos
        for b in self.s_blocks:
            h = b(h)
        h = self.s_ln_f(h)
        B, N, D = h.shape
        hs = D // self.H
        q = self.map_q(self.probe).view(1, self.H, 1, hs)  # the same query for every row
        k = self.map_k(h).view(B, N, self.H, hs).transpose(1, 2)
        v = self.map_v(h).view(B, N, self.H, hs).transpose(1, 2)
        att = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs)), dim=-1)
        y = self.map_out((att @ v).reshape(B, D))
        y = y + self.map_fc2(F.gelu(self.map_fc1(self.map_ln(y)), approximate="tanh"))
        return F.normalize(self.s_proj(y), dim=-1, eps=1e-12)

    def text(self, tok, end):
        h = self.tok(tok) + self.t_pos
        for b in self.t_blocks:
            h = b(h)
        h = self.t_ln_f(h)[torch.arange(tok.shape[0]), end]
        return F.normalize(self.t_proj(h), dim=-1, eps=1e-12)

    def forward(self, p, tok, end):
        s, u = self.sensor(p), self.text(tok, end)
        z = self.logit_scale.exp() * (s @ u.t()) + self.logit_bias
        y = 2.0 * torch.eye(z.shape[0]) - 1.0
        return -F.logsigmoid(y * z).sum() / z.shape[0]


def slm_flops(D, depth, M, E, N, P, L, B):
    """bench_sensorlm's count (train/sensorlm.c td_sensorlm_flops): 6 per weight per row, 12
    per attention score, 6 when causal; the MAP head; the dot products of the loss."""
    def block(keys, causal):
        return 6.0 * (4.0 * D * D + 2.0 * D * M) + (6.0 if causal else 12.0) * D * keys
    tokens, text = B * N, B * L
    f = tokens * 6.0 * D * P + tokens * depth * block(N, False)
    f += tokens * (6.0 * 2.0 * D * D + 12.0 * D) + B * 6.0 * (D * D + 2.0 * D * M) + 6.0 * D * D
    f += B * 6.0 * D * E + text * depth * block(L, True) + B * 6.0 * D * E
    return f + 6.0 * B * B * E


def slm_inputs(n, T, C, L):
    """n windows drawn as bench_sensorlm draws them (a random walk around 60 + 10c per
    channel, 3% NaN) and captions of 30 to 120 bytes as tokens (bytes, the end token 256, pads
    257)."""
    g = torch.Generator().manual_seed(1)
    steps = torch.rand(n, T, C, generator=g) - 0.5
    grids = 60.0 + 10.0 * torch.arange(C, dtype=torch.float32) + steps.cumsum(1)
    grids += torch.rand(n, T, C, generator=g)
    grids[torch.rand(n, T, C, generator=g) < 0.03] = float("nan")
    words = b"a calm day with a morning run and an evening walk after work "
    tok = torch.full((n, L), 257, dtype=torch.long)
    end = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        length = 30 + (i * 37) % 91
        cap = bytes(words[(i + j) % len(words)] for j in range(length))[:L - 1]
        tok[i, :len(cap)] = torch.tensor(list(cap))
        tok[i, len(cap)] = 256
        end[i] = len(cap)
    return grids, tok, end


def bench_slm(args, name):
    D, depth, H, M, E, B, steps = SLM_PRESETS[name]
    steps = args.slm_steps or steps
    T, C, pt, pc, L = 1440, 10, 10, 2, 64
    Cp = (C + pc - 1) // pc * pc
    N, P = (T // pt) * (Cp // pc), pt * pc
    n = 4 * B
    grids, tok, end = slm_inputs(n, T, C, L)
    flat = grids.reshape(-1, C)
    mean = torch.nanmean(flat, 0)
    std = torch.sqrt(torch.nanmean((flat - mean) ** 2, 0))
    torch.manual_seed(1)
    model = SensorLM(D, depth, H, M, E, N, P, L)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    n_params = sum(p.numel() for p in model.parameters())
    flops = slm_flops(D, depth, M, E, N, P, L, B)
    pos = [0]

    def step():
        i = pos[0] if pos[0] + B <= n else 0
        pos[0] = i + B
        # the batch as the trainer builds it each step: normalised, NaN -> 0, patched
        x = torch.nan_to_num((grids[i:i + B] - mean) / std, nan=0.0)
        x = F.pad(x, (0, Cp - C)).view(B, T // pt, pt, Cp // pc, pc)
        x = x.permute(0, 1, 3, 2, 4).reshape(B, N, P)
        opt.zero_grad(set_to_none=True)
        loss = model(x, tok[i:i + B], end[i:i + B])
        loss.backward()
        opt.step()

    ms = time_steps(step, SLM_WARMUP, steps)
    mean_ms = sum(ms) / len(ms)
    print(f"PyTorch {torch.__version__} sensorlm {name}: D={D} depth {depth} H={H} M={M} "
          f"N={N} P={P} L={L} E={E}, batch {B}, adamw, {torch.get_num_threads()} threads "
          f"({n_params / 1e6:.2f}M parameters):")
    print(f"  {mean_ms:.1f} ms/step (best {min(ms):.1f}) over {len(ms)} steps, "
          f"{B / (mean_ms / 1e3):.2f} samples/s, {flops / (mean_ms * 1e6):.1f} GFLOP/s; "
          f"{BUSY:.2f} of {os.cpu_count()} cores busy")


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
    p.add_argument("--slm", choices=["tiny", "small", "all"])
    p.add_argument("--slm-steps", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--data", default="/usr/share/games/fortunes/*")
    p.add_argument("--mnist", default="/usr/share/datasets/fashion-mnist")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.gpt_steps > 0:
        bench_gpt(args)
    for name in (["tiny", "small"] if args.slm == "all" else [args.slm] if args.slm else []):
        bench_slm(args, name)
    if args.mlp_steps > 0:
        if os.path.isdir(args.mnist):
            bench_mlp(args)
        else:
            print(f"MLP: skipped, no {args.mnist}", file=sys.stderr)


if __name__ == "__main__":
    main()
