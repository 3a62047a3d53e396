"""Translation: an encoder-decoder transformer trained with DDP, validated by greedy decoding.

By default it learns to translate dates as people write them into ISO dates (a corpus generated
on the fly, see `dates.py`); `data.path=pairs.tsv` trains on any parallel corpus instead.
Validation decodes the whole validation set, sharded over the ranks with no sample twice, and
reports character and word error rates and BLEU (torchmetrics) plus a few decoded examples.

    ddplab run translation -n 2

Resuming, checkpoints, W&B re-attachment and progress bars come from `ddplab.Experiment`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

import ddplab
from ddplab.config import CheckpointConfig, TrainerConfig, setting
from ddplab.config_rules import Range
from ddplab.errors import ConfigError

from . import dates
from .parallel_text import PAD_ID, ParallelDataset, Vocab, collate, read_tsv
from .transformer import Seq2SeqTransformer, greedy_decode


@dataclass
class DataConfig:
    path: str = setting("", "a TSV of source<TAB>target lines; empty: the generated dates corpus")
    tokenize: Literal["char", "word"] = setting("char", "the tokens: characters or words")
    n_train: int = setting(10000, "sizes of the generated corpus", rule=Range(1))
    n_valid: int = setting(500, "validation sentences of the generated corpus", rule=Range(1))
    valid_fraction: float = setting(0.05, "of a TSV's pairs", rule=Range(0, 1, open=True, below=True))
    seed: int = setting(0, "corpus generation and the TSV's train/valid split", rule=Range(0))
    max_src_len: int = setting(80, "tokens, BOS and EOS included (longer sentences are cut)", rule=Range(3))
    max_tgt_len: int = setting(24, "target tokens, BOS and EOS included; also the decoding limit", rule=Range(3))
    examples: int = setting(3, "decoded validation examples printed per evaluation", rule=Range(0))


@dataclass
class ModelConfig:
    d_model: int = setting(128, "transformer width", rule=Range(1))
    heads: int = setting(4, "attention heads (must divide d_model)", rule=Range(1))
    encoder_layers: int = setting(2, "transformer encoder layers", rule=Range(1))
    decoder_layers: int = setting(2, "transformer decoder layers", rule=Range(1))
    feedforward: int = setting(256, "width of each layer's feed-forward block", rule=Range(1))
    dropout: float = setting(0.1, "in attention, feed-forward and embeddings", rule=Range(0, 1, below=True))
    max_positions: int = setting(256, "longest sequence the positional encoding covers", rule=Range(1))


@dataclass
class OptimConfig:
    lr: float = setting(1e-3, "peak learning rate, reached after warmup_steps", rule=Range(0, open=True))
    warmup_steps: int = setting(
        100, "linear warm-up, then the decay below (a run no longer than this: a tenth of it)", rule=Range(0)
    )
    decay: Literal["cosine", "linear", "inverse_sqrt"] = setting(
        "cosine", "cosine | linear: to 0 at the run's last step (ddplab.warmup_schedule) | inverse_sqrt"
    )
    label_smoothing: float = setting(0.1, "of the cross-entropy loss", rule=Range(0, 1, below=True))
    weight_decay: float = setting(0.0, "AdamW weight decay", rule=Range(0))


@dataclass
class TranslationConfig(ddplab.Config):
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(global_batch_size=128, max_epochs=6, log_every=10, eval_batch_size=250)
    )
    checkpoint: CheckpointConfig = field(
        default_factory=lambda: CheckpointConfig(every_epoch=True, keep_last=2, keep_best=1, monitor="cer", mode="min")
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


def warmup_then_inverse_sqrt(step: int, warmup: int) -> float:
    """The learning-rate factor at optimizer step `step`: linear up to 1 at `warmup`, then sqrt decay."""
    s = step + 1
    return min(s / warmup, (warmup / s) ** 0.5) if warmup > 0 else 1.0


class Translation(ddplab.Experiment):
    config_class = TranslationConfig
    name = "translation"
    collate_fn = staticmethod(collate)

    def build(self):
        self._load_data()
        m = self.cfg.model
        o = self.cfg.optim
        self.net = Seq2SeqTransformer(
            len(self.src_vocab),
            len(self.tgt_vocab),
            m.d_model,
            m.heads,
            m.encoder_layers,
            m.decoder_layers,
            m.feedforward,
            m.dropout,
            m.max_positions,
        )
        self.opt = torch.optim.AdamW(
            self.net.parameters(), lr=o.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=o.weight_decay
        )
        if o.decay == "inverse_sqrt":
            # no end: the rate falls as 1/sqrt(step) however long the run is
            self.sched = torch.optim.lr_scheduler.LambdaLR(
                self.opt, lambda step: warmup_then_inverse_sqrt(step, o.warmup_steps)
            )
        else:
            # the run's length, as ddplab counts it, is known here; a run no longer than the
            # warm-up warms up for a tenth of its steps instead, so the example runs at any length
            warmup = o.warmup_steps if o.warmup_steps < self.total_steps else self.total_steps // 10
            self.sched = ddplab.warmup_schedule(self.opt, warmup, self.total_steps, decay=o.decay)
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=PAD_ID, label_smoothing=o.label_smoothing)

    def _load_data(self):
        d = self.cfg.data
        if max(d.max_src_len, d.max_tgt_len) > self.cfg.model.max_positions:
            raise ConfigError(
                f"data.max_src_len={d.max_src_len} / data.max_tgt_len={d.max_tgt_len} exceed "
                f"model.max_positions={self.cfg.model.max_positions}",
                "raise model.max_positions",
            )
        if d.path:
            pairs = read_tsv(d.path)
            random.Random(d.seed).shuffle(pairs)
            n_valid = max(1, round(len(pairs) * d.valid_fraction))
            train = pairs[n_valid:]
            valid = pairs[:n_valid]
        else:
            pairs = dates.date_pairs(d.n_train + d.n_valid, d.seed)
            train = pairs[: d.n_train]
            valid = pairs[d.n_train :]
        self.src_vocab = Vocab.build([s for s, _ in train], d.tokenize)
        self.tgt_vocab = Vocab.build([t for _, t in train], d.tokenize)
        self.train_set = ParallelDataset(train, self.src_vocab, self.tgt_vocab, d.max_src_len, d.max_tgt_len)
        self.valid_set = ParallelDataset(valid, self.src_vocab, self.tgt_vocab, d.max_src_len, d.max_tgt_len)

    def train_dataset(self):
        return self.train_set

    def eval_dataset(self):
        return self.valid_set

    def training_step(self, batch):
        src = batch["src"]
        tgt = batch["tgt"]
        logits = self.net(src, tgt[:, :-1])
        return self.loss_fn(logits.reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1))

    def count_tokens(self, batch):
        """The target tokens the loss is taken over (padding excluded): what tokens/s counts."""
        return (batch["tgt"][:, 1:] != PAD_ID).sum()

    def evaluation_step(self, batch):
        """Per sentence: the teacher-forced loss (summed over its tokens), its token count, the
        greedy decoding and the reference, both padded to a fixed width so ranks can gather them."""
        src = batch["src"]
        tgt = batch["tgt"]
        gold = tgt[:, 1:]
        logits = self.net(src, tgt[:, :-1]).float()
        token_loss = nn.functional.cross_entropy(logits.transpose(1, 2), gold, ignore_index=PAD_ID, reduction="none")
        width = self.cfg.data.max_tgt_len - 1
        return {
            "loss_sum": token_loss.sum(1),
            "tokens": (gold != PAD_ID).sum(1),
            "decoded": greedy_decode(self.net, src, width),
            "reference": nn.functional.pad(gold, (0, width - gold.size(1)), value=PAD_ID),
        }

    def evaluation_metrics(self, out):
        hyps = [self.tgt_vocab.decode(row) for row in out["decoded"].tolist()]
        refs = [self.tgt_vocab.decode(row) for row in out["reference"].tolist()]
        metrics = {
            "loss": (out["loss_sum"].double().sum() / out["tokens"].sum().clamp(min=1)).item(),
            "sentences": len(refs),
        }
        metrics.update(text_metrics(hyps, refs, self.cfg.data.tokenize))
        sources = [s for s, _ in self.valid_set.pairs] if len(hyps) == len(self.valid_set) else [""] * len(hyps)
        self.examples = list(zip(sources, hyps, refs, strict=True))[: self.cfg.data.examples]
        return metrics

    def on_evaluation_end(self, metrics):
        for source, hyp, ref in self.examples:
            self.print(f"  {source!r} -> {hyp!r} (reference {ref!r})")

    def on_fit_end(self):
        m = self.last_eval
        self.print(
            f"translation: validation CER {m['cer']:.4f}  WER {m['wer']:.4f}  BLEU {m['bleu']:.4f}  "
            f"exact {m['exact']:.3f} at step {self.step}; run dir {self.run_dir}"
        )


def text_metrics(hyps: list[str], refs: list[str], level: str) -> dict[str, float]:
    """CER over characters, WER over whitespace words, BLEU-4 over the model's own tokens (characters
    for char-level models: a space becomes '▁' so it stays a token), and exact-match rate."""
    from torchmetrics.functional.text import bleu_score, char_error_rate, word_error_rate

    def tokens(text):
        return " ".join(c if c != " " else "▁" for c in text) if level == "char" else text

    return {
        "cer": char_error_rate(hyps, refs).item(),
        "wer": word_error_rate(hyps, refs).item(),
        "bleu": bleu_score([tokens(h) for h in hyps], [[tokens(r)] for r in refs]).item(),
        "exact": sum(h == r for h, r in zip(hyps, refs, strict=True)) / max(len(refs), 1),
    }
