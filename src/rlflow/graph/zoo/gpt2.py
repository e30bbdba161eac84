"""GPT-2 small (random weights), laid out like Hugging Face's ``GPT2Model`` (no LM head).

Architecture facts (GPT-2 small): 12 pre-LayerNorm decoder blocks, hidden 768, 12 heads (head size 64), MLP 3072
with GELU (tanh approximation), vocabulary 50257, 1024 learned positions, LayerNorm eps 1e-5, a final LayerNorm.

* Embeddings: token embedding of ``input_ids`` + position embedding of ``arange(seq)`` (a registered buffer
  sliced to the sequence length); no dropout (eval only).
* Attention: one fused Q/K/V Linear (HF's ``c_attn``, a Conv1D there) split in three, scores / sqrt(head size),
  the causal mask as OpenAI's original GPT-2 applies it (``w * b - 1e10 * (1 - b)`` with ``b`` a registered
  lower-triangular float buffer; HF's ``where`` form is an op outside this project's op registry),
  softmax, context, output projection (``c_proj``), residual.
* MLP: Linear 4x + GELU(tanh) + Linear, residual.

Input ``input_ids`` int64 [batch, seq]; output ``last_hidden_state`` float32 [batch, seq, hidden].
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from rlflow.errors import RLFlowError

from ._common import ModelSpec, input_generator

DEFAULT_SIZES = {"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072, "seq": 128, "batch": 1, "vocab": 50257,
                 "max_positions": 1024}
TINY_SIZES = {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "seq": 8, "batch": 1, "vocab": 100,
              "max_positions": 16}
OUTPUT_NAME = "last_hidden_state"
LN_EPS = 1e-5


class GPT2Attention(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.heads, self.hidden = s["heads"], s["hidden"]
        self.head_size = s["hidden"] // s["heads"]
        self.c_attn = nn.Linear(s["hidden"], 3 * s["hidden"])
        self.c_proj = nn.Linear(s["hidden"], s["hidden"])
        n = s["max_positions"]
        self.register_buffer("bias", torch.tril(torch.ones((n, n))).view(1, 1, n, n),
                             persistent=False)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.hidden, dim=2)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size)
        seq = x.shape[1]
        causal = self.bias[:, :, :seq, :seq]
        scores = scores * causal - 1e10 * (1.0 - causal)
        context = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
        batch = context.shape[0]
        return self.c_proj(context.view(batch, seq, self.hidden))


class GPT2Block(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.ln_1 = nn.LayerNorm(s["hidden"], eps=LN_EPS)
        self.attn = GPT2Attention(s)
        self.ln_2 = nn.LayerNorm(s["hidden"], eps=LN_EPS)
        self.c_fc = nn.Linear(s["hidden"], s["ffn"])
        self.c_proj = nn.Linear(s["ffn"], s["hidden"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 decoder stack: token + position embeddings, ``layers`` pre-LN blocks, final LayerNorm."""

    def __init__(self, s: dict):
        super().__init__()
        if s["hidden"] % s["heads"]:
            raise RLFlowError(f"gpt2: hidden {s['hidden']} is not divisible by heads {s['heads']}")
        if s["seq"] > s["max_positions"]:
            raise RLFlowError(f"gpt2: seq {s['seq']} exceeds max_positions {s['max_positions']}")
        self.wte = nn.Embedding(s["vocab"], s["hidden"])
        self.wpe = nn.Embedding(s["max_positions"], s["hidden"])
        self.register_buffer("position_ids", torch.arange(s["max_positions"]).view(1, -1), persistent=False)
        self.h = nn.ModuleList(GPT2Block(s) for _ in range(s["layers"]))
        self.ln_f = nn.LayerNorm(s["hidden"], eps=LN_EPS)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(self.position_ids[:, :seq])
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


def example_inputs(sizes: dict, seed: int) -> dict[str, torch.Tensor]:
    """``input_ids``: int64 [batch, seq], uniform over the vocabulary."""
    shape = (sizes["batch"], sizes["seq"])
    return {"input_ids": torch.randint(0, sizes["vocab"], shape, generator=input_generator(seed))}


MODELS = {"gpt2": ModelSpec(GPT2, example_inputs, DEFAULT_SIZES, TINY_SIZES, OUTPUT_NAME)}
