"""
Check your own model with minizero: copy this file, put your model in make_model() and
your data in make_batch(), then run

    python minizero.py check example_check.py                       # worlds 1-4, stages 0-3
    python minizero.py check example_check.py --dtype bf16 --grad-accum 2 --jitter

It trains the model under DDP and every ZeRO stage and reports the first step, rank and
parameter where any two differ. Exit status: 0 all agree, 1 something diverged, 2 bad input.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Output:  # models often return a dataclass: the check takes out.loss
    logits: torch.Tensor
    loss: torch.Tensor


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TextClassifier(nn.Module):
    """Embedding, a stack of residual MLP blocks (each block one ZeRO unit), mean pooling,
    and a head; called with keyword arguments, returning a dataclass. 1.0M parameters."""

    def __init__(self, vocab=1000, d=160, depth=3, classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x).mean(dim=1))
        return Output(logits, F.cross_entropy(logits.float(), labels))


def make_model():
    torch.manual_seed(0)  # called once: every rank and stage starts from this model
    return TextClassifier()


def make_batch(step, rank, micro):
    """This rank's micro-batch: a dict of keyword arguments (or a tuple of positional ones)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return dict(tokens=torch.randint(0, 1000, (8, 32), generator=g),
                labels=torch.randint(0, 10, (8,), generator=g))


# optional: how to get the loss (the default calls the model and takes out.loss)
def loss_fn(model, batch):
    return model(**batch).loss


def decay(name, p):  # weight decay on matrices only (nanoGPT's rule)
    return p.dim() >= 2


# options for minizero.Engine: lr, weight_decay, decay, clip, grad_accum, dtype, units, overlap, ...
ENGINE = dict(lr=1e-3, weight_decay=0.1, clip=1.0, decay=decay)
