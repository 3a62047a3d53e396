"""An encoder-decoder transformer built from `torch.nn` pieces, and greedy decoding.

Masks, the part that is easy to get wrong:
  * source padding: encoder self-attention and decoder cross-attention never read PAD positions;
  * target padding: decoder self-attention never reads PAD positions;
  * causal: decoder position t reads target positions <= t only, so training with teacher
    forcing sees exactly what decoding will see.
All masks are boolean (True = may not attend), the form torch's attention takes without a warning.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .parallel_text import BOS_ID, EOS_ID, PAD_ID


def causal_mask(size: int, device: torch.device | None = None) -> torch.Tensor:
    """(size, size) bool mask: True above the diagonal, where a position would see its future."""
    return torch.triu(torch.ones(size, size, dtype=torch.bool, device=device), diagonal=1)


def sinusoidal_positions(max_len: int, d_model: int) -> torch.Tensor:
    position = torch.arange(max_len).unsqueeze(1)
    div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)[:, : d_model // 2]
    return table


class Seq2SeqTransformer(nn.Module):
    """Embeddings + sinusoidal positions -> pre-norm encoder/decoder stacks -> vocabulary logits."""

    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        d_model: int = 128,
        heads: int = 4,
        encoder_layers: int = 2,
        decoder_layers: int = 2,
        feedforward: int = 256,
        dropout: float = 0.1,
        max_positions: int = 256,
    ):
        super().__init__()
        self.d_model = d_model
        self.src_embed = nn.Embedding(src_vocab, d_model, padding_idx=PAD_ID)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model, padding_idx=PAD_ID)
        self.register_buffer("positions", sinusoidal_positions(max_positions, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

        def layer(kind):
            return kind(d_model, heads, feedforward, dropout, batch_first=True, norm_first=True)

        self.encoder = nn.TransformerEncoder(
            layer(nn.TransformerEncoderLayer), encoder_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        self.decoder = nn.TransformerDecoder(
            layer(nn.TransformerDecoderLayer), decoder_layers, norm=nn.LayerNorm(d_model)
        )
        self.project = nn.Linear(d_model, tgt_vocab)
        for table in (self.src_embed, self.tgt_embed):
            # scaled by sqrt(d_model) in embed(): unit size, like positions
            nn.init.normal_(table.weight, std=d_model**-0.5)
            table.weight.data[PAD_ID].zero_()

    def embed(self, table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        if ids.size(1) > self.positions.size(0):
            raise ValueError(
                f"sequence of {ids.size(1)} tokens, longer than model.max_positions={self.positions.size(0)}"
            )
        return self.dropout(table(ids) * math.sqrt(self.d_model) + self.positions[: ids.size(1)])

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(self.src_embed, src), src_key_padding_mask=src == PAD_ID)

    def decode(self, memory: torch.Tensor, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Logits for the next token at every position of `tgt_in` (teacher forcing)."""
        out = self.decoder(
            self.embed(self.tgt_embed, tgt_in),
            memory,
            tgt_mask=causal_mask(tgt_in.size(1), tgt_in.device),
            tgt_key_padding_mask=tgt_in == PAD_ID,
            memory_key_padding_mask=src == PAD_ID,
            tgt_is_causal=True,
        )
        return self.project(out)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(src), src, tgt_in)


@torch.no_grad()
def greedy_decode(model: Seq2SeqTransformer, src: torch.Tensor, max_len: int) -> torch.Tensor:
    """(batch, max_len) token ids: the most likely token at each step, EOS included, PAD after it.

    The source is encoded once; each step re-reads the decoded prefix. Rows that reached EOS keep
    producing PAD, and decoding stops when every row has finished."""
    memory = model.encode(src)
    out = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        next_id = model.decode(memory, src, out)[:, -1].argmax(-1)
        next_id = torch.where(done, torch.full_like(next_id, PAD_ID), next_id)
        out = torch.cat([out, next_id.unsqueeze(1)], dim=1)
        done |= next_id == EOS_ID
        if bool(done.all()):
            break
    tokens = out[:, 1:]
    return nn.functional.pad(tokens, (0, max_len - tokens.size(1)), value=PAD_ID)
