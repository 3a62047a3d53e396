"""alignment_stats outputs: one .npz of arrays (layout below) and PNG plots.

`results/alignment_stats.npz`, with M measurements, W ranks, R replicate networks, N_l neurons
and D_l input features of layer l, F dropout fractions:

    steps                    (M,)               optimizer step of each measurement
    alignment_layer{l}       (M, W, R, N_l)     per-rank replicates, rank r measured on its own batch
    delta_norm_layer{l}      (M, R, N_l)        ||w - w_initial|| per neuron (the same on every rank)
    delta_weights_layer{l}   (R, N_l, D_l)      final w - w_initial
    train_steps, train_loss, train_acc          training curves (mean over replicates; every log_every steps)
    eval_steps, eval_loss, eval_acc (E,)        test curves (mean over replicates)
    fractions                (F,)
    targeted_dropout         (3, S, F, R, 2)    modes high/low/random; scopes all + each hidden layer;
                                                last axis: loss, accuracy
    eigenvalues_layer{l}     (R, D_l)           descending
    eigen_dropout            (2, L, F, R, 2)    modes high/low (which eigenfeatures are dropped);
                                                the fully connected layers `eigen_dropout_layers`
"""

from __future__ import annotations

import os

import numpy as np

from .analysis import DROPOUT_MODES, EIGEN_MODES


def save_results(folder, history, dropout, scopes, eigen, eig_drop, eig_layers, fractions, deltas, world) -> dict:
    layers = len(history["alignment"][0]) if history["alignment"] else len(deltas)
    out: dict[str, np.ndarray] = {
        "steps": np.asarray(history["steps"]),
        "fractions": np.asarray(fractions),
        "targeted_dropout": dropout.numpy(),
        "targeted_dropout_scopes": np.asarray(scopes),
        "eigen_dropout": eig_drop.numpy(),
        "eigen_dropout_layers": np.asarray(eig_layers),
        "world_size": np.asarray(world),
    }
    for layer in range(layers):
        if history["alignment"]:
            out[f"alignment_layer{layer}"] = np.stack([m[layer] for m in history["alignment"]])
            out[f"delta_norm_layer{layer}"] = np.stack([m[layer] for m in history["delta_norm"]])
        out[f"delta_weights_layer{layer}"] = deltas[layer]
        out[f"eigenvalues_layer{layer}"] = np.stack([net[layer][0].cpu().numpy() for net in eigen])
    if history["eval"]:
        steps, loss, acc = zip(*history["eval"], strict=True)
        out.update(eval_steps=np.asarray(steps), eval_loss=np.asarray(loss), eval_acc=np.asarray(acc))
    out.update(_train_curve(os.path.join(os.path.dirname(folder), "metrics.jsonl")))
    np.savez(os.path.join(folder, "alignment_stats.npz"), **out)
    return out


def _train_curve(metrics_path: str) -> dict[str, np.ndarray]:
    """train_steps, train_loss (per network), train_acc from the run's metrics.jsonl."""
    import json

    rows = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            rows = [r for r in map(json.loads, f) if "train/loss_per_net" in r]
    return {
        "train_steps": np.asarray([r["step"] for r in rows]),
        "train_loss": np.asarray([r["train/loss_per_net"] for r in rows]),
        "train_acc": np.asarray([r["train/acc"] for r in rows]),
    }


def _accuracy_by_fraction(plt, fractions, results, panels, modes, title, xlabel, legend_title):
    """One panel per scope/layer: mean test accuracy over replicates against the fraction, per mode.
    `results` is (modes, panels, fractions, replicates, [loss, accuracy])."""
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), sharey=True)
    axes = np.atleast_1d(axes)
    for p, (ax, panel) in enumerate(zip(axes, panels, strict=False)):
        for m, mode in enumerate(modes):
            ax.plot(fractions, results[m, p, :, :, 1].mean(axis=1), marker=".", label=mode)
        ax.set(title=title.format(panel), xlabel=xlabel)
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(title=legend_title)
    return fig


def save_plots(folder: str, results: dict) -> list[str]:
    """The analysis as PNG figures in `folder`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {
        "curves.png": _curves(plt, results),
        "alignment.png": _alignment(plt, results),
        "targeted_dropout.png": _accuracy_by_fraction(
            plt,
            results["fractions"],
            results["targeted_dropout"],
            list(results["targeted_dropout_scopes"]),
            DROPOUT_MODES,
            "targeted dropout: {}",
            "fraction removed",
            "alignment",
        ),
        "eigenspectra.png": _eigenspectra(plt, results),
        "eigen_dropout.png": _accuracy_by_fraction(
            plt,
            results["fractions"],
            results["eigen_dropout"],
            [f"layer{i}" for i in results["eigen_dropout_layers"]],
            [f"drop {m}" for m in EIGEN_MODES],
            "eigenfeature dropout: {}",
            "fraction of eigenfeatures dropped",
            None,
        ),
    }
    paths = []
    for name, fig in figures.items():
        # a run without per-layer alignment has no alignment figure
        if fig is None:
            continue
        fig.tight_layout()
        paths.append(os.path.join(folder, name))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _curves(plt, results: dict):
    """Loss and accuracy over training, train and test."""
    fig, (loss, accuracy) = plt.subplots(1, 2, figsize=(9, 3.5))
    for split, style in (("train", "-"), ("eval", "o-")):
        if len(results.get(f"{split}_steps", [])):
            label = "test" if split == "eval" else split
            loss.plot(results[f"{split}_steps"], results[f"{split}_loss"], style, label=label)
            accuracy.plot(results[f"{split}_steps"], results[f"{split}_acc"], style, label=label)
    loss.set(title="loss (mean over replicates)", xlabel="step", ylabel="cross-entropy")
    accuracy.set(title="accuracy (mean over replicates)", xlabel="step", ylabel="accuracy")
    loss.legend()
    return fig


def _alignment(plt, results: dict):
    """Each layer's mean alignment during training (None when none was measured)."""
    layer_keys = sorted(key for key in results if key.startswith("alignment_layer"))
    if not layer_keys:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in layer_keys:
        # over ranks, replicates, neurons
        mean = results[key].mean(axis=(1, 2, 3))
        ax.plot(results["steps"], mean, label=key.replace("alignment_", ""))
    ax.set(title="mean alignment per layer during training", xlabel="step", ylabel="alignment")
    ax.legend()
    return fig


def _eigenspectra(plt, results: dict):
    """The eigenvalues of each layer's input covariance on the test set."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted(key for key in results if key.startswith("eigenvalues_layer")):
        values = results[key].mean(axis=0)
        ranks = np.arange(1, len(values) + 1)
        ax.loglog(ranks, np.clip(values, 1e-12, None), label=key.replace("eigenvalues_", ""))
    ax.set(title="eigenspectra of layer inputs (test set)", xlabel="rank", ylabel="eigenvalue")
    ax.legend()
    return fig
