"""BERT-Base encoder, laid out like Hugging Face's ``BertModel`` (without the pooler).

Architecture facts (BERT-Base): 12 post-LayerNorm encoder layers, hidden 768, 12 heads (head size 64),
FFN 3072 with exact GELU, vocabulary 30522, 512 learned positions, 2 token types, LayerNorm eps 1e-12.

* Embeddings: word embedding of ``input_ids`` + position embedding of ``position_ids`` (a registered
  buffer ``arange(max_positions)`` sliced to the sequence length) + token-type embedding of an
  all-zeros buffer, then LayerNorm (dropout is absent: eval only).
* Attention mask: built inside ``forward`` as HF does, from an all-ones mask of ``input_ids``' shape,
  turned into an additive mask with ``==``/``where``/``expand``. The export therefore contains
  mask-building ops (Shape/ConstantOfShape/Equal/Where/Expand or their folded forms).
* Self-attention with separate Q/K/V Linear layers, scores / sqrt(head size) + mask, softmax,
  context, output dense, residual, LayerNorm; FFN dense + GELU + dense, residual, LayerNorm.

Input ``input_ids`` int64 [batch, seq]; output ``last_hidden_state`` float32 [batch, seq, hidden].
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from rlflow.errors import RLFlowError

from ._common import ModelSpec, input_generator

DEFAULT_SIZES = {
    "layers": 12,
    "hidden": 768,
    "heads": 12,
    "ffn": 3072,
    "seq": 128,
    "batch": 1,
    "vocab": 30522,
    "max_positions": 512,
    "type_vocab": 2,
}
TINY_SIZES = {
    "layers": 2,
    "hidden": 32,
    "heads": 2,
    "ffn": 64,
    "seq": 8,
    "batch": 1,
    "vocab": 100,
    "max_positions": 16,
    "type_vocab": 2,
}
OUTPUT_NAME = "last_hidden_state"
LN_EPS = 1e-12


class BertEmbeddings(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.word_embeddings = nn.Embedding(s["vocab"], s["hidden"])
        self.position_embeddings = nn.Embedding(s["max_positions"], s["hidden"])
        self.token_type_embeddings = nn.Embedding(s["type_vocab"], s["hidden"])
        self.LayerNorm = nn.LayerNorm(s["hidden"], eps=LN_EPS)
        self.register_buffer("position_ids", torch.arange(s["max_positions"]).expand((1, -1)), persistent=False)
        self.register_buffer(
            "token_type_ids", torch.zeros((1, s["max_positions"]), dtype=torch.long), persistent=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        position_ids = self.position_ids[:, :seq]
        token_type_ids = self.token_type_ids[:, :seq].expand(batch, seq)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.heads = s["heads"]
        self.head_size = s["hidden"] // s["heads"]
        self.query = nn.Linear(s["hidden"], s["hidden"])
        self.key = nn.Linear(s["hidden"], s["hidden"])
        self.value = nn.Linear(s["hidden"], s["hidden"])

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.split_heads(self.query(x))
        k = self.split_heads(self.key(x))
        v = self.split_heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size)
        probs = torch.softmax(scores + mask, dim=-1)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        batch, seq = context.shape[:2]
        return context.view(batch, seq, self.heads * self.head_size)


class BertLayer(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.attention = BertSelfAttention(s)
        self.attention_output = nn.Linear(s["hidden"], s["hidden"])
        self.attention_norm = nn.LayerNorm(s["hidden"], eps=LN_EPS)
        self.intermediate = nn.Linear(s["hidden"], s["ffn"])
        self.output = nn.Linear(s["ffn"], s["hidden"])
        self.output_norm = nn.LayerNorm(s["hidden"], eps=LN_EPS)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(self.attention_output(self.attention(x, mask)) + x)
        h = F.gelu(self.intermediate(x), approximate="none")
        return self.output_norm(self.output(h) + x)


class Bert(nn.Module):
    """BERT encoder: embeddings, HF-style additive attention mask, ``layers`` encoder layers."""

    def __init__(self, s: dict):
        super().__init__()
        if s["hidden"] % s["heads"]:
            raise RLFlowError(f"bert: hidden {s['hidden']} is not divisible by heads {s['heads']}")
        if s["seq"] > s["max_positions"]:
            raise RLFlowError(f"bert: seq {s['seq']} exceeds max_positions {s['max_positions']}")
        self.heads = s["heads"]
        self.embeddings = BertEmbeddings(s)
        self.layers = nn.ModuleList(BertLayer(s) for _ in range(s["layers"]))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        # HF builds an all-ones attention mask when none is given, then an additive [b, h, s, s] mask.
        # (float32 tensors, not Python floats, in the where: the TorchScript exporter would make it double)
        mask = torch.ones((batch, seq), dtype=torch.long, device=input_ids.device)
        masked = torch.full((), torch.finfo(torch.float32).min, device=input_ids.device)
        kept = torch.zeros((), device=input_ids.device)
        extended = torch.where(mask[:, None, None, :] == 0, masked, kept).expand(batch, self.heads, seq, seq)
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, extended)
        return x


def example_inputs(sizes: dict, seed: int) -> dict[str, torch.Tensor]:
    """``input_ids``: int64 [batch, seq], uniform over the vocabulary."""
    shape = (sizes["batch"], sizes["seq"])
    return {"input_ids": torch.randint(0, sizes["vocab"], shape, generator=input_generator(seed))}


MODELS = {"bert": ModelSpec(Bert, example_inputs, DEFAULT_SIZES, TINY_SIZES, OUTPUT_NAME)}
