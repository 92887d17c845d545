"""Loads examples/gpt.cpp's exported weights into the same model written in PyTorch.

    python3 load_in_python.py OUT_DIR

The model is written from docs/gpt.md ("The architecture, exactly") alone: RMSNorm with epsilon
1e-5 and its weight after normalising, q/k/v as the three dim-wide blocks of qkv's output (heads
contiguous in each), RoPE in halves with tables computed here from base 10000, the causal and
same-document mask, exact GELU, no biases, no tie.

OUT_DIR holds gpt.pt, gpt.safetensors and gpt_probe.pt (token ids and the C++ model's logits for
them). The weights are loaded from each file, strictly (every name present, none left over); the
file's RoPE tables and causal mask must equal the ones computed here, and the PyTorch model's
logits the probe's within 1e-5. Exits 1 otherwise.
"""
import json
import math
import struct
import sys
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def rope_tables(context, half, base=10000.0):
    """angle[p, i] = p * base^(-i/half) in float64, for p < context, i < half; cos, sin in float32."""
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """Halves (GPT-NeoX), not interleaved: feature j < half pairs with j + half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, d = x.shape
        # qkv's output features: q, k, v blocks of d each; in each, head h's hd features together.
        parts = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(parts[0], cos, sin), apply_rope(parts[1], cos, sin)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        weights = torch.softmax(scores.masked_fill(mask.logical_not(), float("-inf")), -1)
        return self.proj(torch.matmul(weights, parts[2]).transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x), approximate="none"))  # exact: the erf form


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = RMSNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = RMSNorm(dim), Mlp(dim)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    """The token embedding; the C++ layer also holds the tables and mask as buffers, which are
    loaded here to be compared with the ones this model computes (`Gpt.tables_match`)."""

    def __init__(self, vocab, dim, context, half):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.register_buffer("rope_cos", torch.zeros(context, half))
        self.register_buffer("rope_sin", torch.zeros(context, half))
        self.register_buffer("causal_mask", torch.zeros(context, context, dtype=torch.bool))


class Head(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.lm = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        return self.lm(self.norm(x))


class Gpt(nn.Module):
    """The C++ model's modules under the same names: embed, block0 .. blockN-1, head."""

    def __init__(self, vocab, dim, heads, layers, context):
        super().__init__()
        self.embed = Embed(vocab, dim, context, dim // heads // 2)
        self.cos, self.sin = rope_tables(context, dim // heads // 2)
        self.causal = torch.ones(context, context, dtype=torch.bool).tril()
        self.layers = layers
        for i in range(layers):
            setattr(self, f"block{i}", Block(dim, heads))
        self.head = Head(dim, vocab)

    def tables_match(self):
        """Whether the loaded buffers are the tables and mask computed from the page."""
        return (torch.equal(self.cos, self.embed.rope_cos) and
                torch.equal(self.sin, self.embed.rope_sin) and
                torch.equal(self.causal, self.embed.causal_mask))

    def forward(self, ids):
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        # Causal, and within the document: a byte 0 starts a new one at its own position.
        doc = ids.eq(0).cumsum(1)
        mask = self.causal[:t, :t].logical_and(doc.unsqueeze(2).eq(doc.unsqueeze(1)))
        x = self.embed.tok(ids)
        for i in range(self.layers):
            x = getattr(self, f"block{i}")(x, cos, sin, mask.unsqueeze(1))
        return self.head(x)


def model_for(weights):
    vocab, dim = weights["embed.tok.weight"].shape
    context, half = weights["embed.rope_cos"].shape
    layers = len({k.split(".")[0] for k in weights if k.startswith("block")})
    return Gpt(vocab, dim, dim // (2 * half), layers, context)


def read_safetensors(path):
    dtypes = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "BOOL": torch.bool, "U8": torch.uint8}
    with open(path, "rb") as f:
        raw = f.read()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    data = raw[8 + size:]
    out = OrderedDict()
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtypes[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def main(out):
    probe = torch.load(f"{out}/gpt_probe.pt")
    ok = True
    for label, weights in (("torch.load", torch.load(f"{out}/gpt.pt")),
                           ("safetensors", read_safetensors(f"{out}/gpt.safetensors"))):
        model = model_for(weights)
        model.load_state_dict(weights, strict=True)
        tables = model.tables_match()
        with torch.no_grad():
            logits = model(probe["ids"])
        diff = (logits - probe["logits"]).abs().max().item()
        good = diff <= 1e-5
        ok = ok and good and tables
        print(f"{label}: {len(weights)} tensors, RoPE tables and mask "
              f"{'as computed' if tables else 'DIFFER from the computed ones'}, logits max |diff| "
              f"{diff:.3g} {'<= 1e-5' if good else '> 1e-5: MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
