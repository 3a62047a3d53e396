"""alignment_stats: the measurement against a float64 NumPy reference, the data loaders, the
replicate layout, and the post-training analyses on 2 ranks against 1."""

import gzip
import struct

import numpy as np
import pytest
import torch

from ddplab.errors import DdplabError
from ddplab.experiments.alignment import AlignmentCNN, AlignmentMLP, DistributedMoments, alignment, covariance
from ddplab.experiments.images import load_images
from helpers import run_target


def test_alignment_matches_a_float64_numpy_reference():
    rng = np.random.default_rng(0)
    # correlated inputs
    x = rng.normal(size=(200, 7)) @ rng.normal(size=(7, 7))
    w = rng.normal(size=(5, 7))
    xc = x - x.mean(0)
    c = xc.T @ xc / (len(x) - 1)
    expected = np.array([(wi @ c @ wi) / (wi @ wi) / np.trace(c) for wi in w])
    got = alignment(torch.from_numpy(w).float(), covariance(torch.from_numpy(x).float())).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # the top eigenvector is the most aligned direction possible: alignment = λ_max / trace
    vals, vecs = np.linalg.eigh(c)
    top = alignment(torch.from_numpy(vecs[:, -1:].T), torch.from_numpy(c)).item()
    assert top == pytest.approx(vals[-1] / vals.sum(), rel=1e-9)


def test_moments_over_pieces_equal_the_whole():
    x = torch.randn(50, 4, dtype=torch.float64)
    m = DistributedMoments(4, torch.device("cpu"))
    m.add(x[:17])
    m.add(x[17:])
    mean, cov = m.covariance()
    assert torch.allclose(mean, x.mean(0)) and torch.allclose(cov, covariance(x))


def test_captured_inputs_dense_and_unfolded_conv():
    x = torch.randn(3, 64)
    mlp = AlignmentMLP(64, 10, (20, 12))
    logits, inputs = mlp(x, capture=True)
    assert logits.shape == (3, 10) and [i.shape for i in inputs] == [(3, 64), (3, 20), (3, 12)]
    cnn = AlignmentCNN(8, 10)
    logits, inputs = cnn(x, capture=True)
    assert logits.shape == (3, 10)
    # patches x (C*k*k)
    assert inputs[0].shape == (3 * 64, 9) and inputs[1].shape == (3 * 64, 8 * 9)
    assert [w.shape[1] for w in cnn.alignment_weights()] == [9, 72, 16 * 64]
    # every neuron of layer 0 removed
    masked = mlp(x, neuron_masks={0: torch.zeros(20)})
    assert torch.allclose(masked, mlp.alignment_layers[2](torch.relu(mlp.alignment_layers[1].bias)).expand(3, 10))


def _mnist_like(n, side=6, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, side, side), dtype=np.uint8), rng.integers(0, 10, size=n).astype(np.uint8)


def test_mnist_from_npz_and_from_idx_files(tmp_path):
    (xtr, ytr), (xte, yte) = _mnist_like(40), _mnist_like(12, seed=1)
    np.savez(tmp_path / "m.npz", x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    train, test, side, classes = load_images(str(tmp_path / "m.npz"), 0)
    assert (len(train), len(test), side) == (40, 12, 6) and classes == int(max(ytr.max(), yte.max())) + 1
    # standardised with the training statistics
    assert abs(train.tensors[0].mean().item()) < 1e-3
    idx = tmp_path / "idx"
    idx.mkdir()
    for name, arr in {
        "train-images-idx3-ubyte": xtr,
        "train-labels-idx1-ubyte": ytr,
        "t10k-images-idx3-ubyte": xte,
        "t10k-labels-idx1-ubyte": yte,
    }.items():
        header = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
        with gzip.open(idx / (name + ".gz"), "wb") as f:
            f.write(header + arr.tobytes())
    train2, test2, _, _ = load_images(str(idx), 0)
    assert torch.equal(train2.tensors[0], train.tensors[0]) and torch.equal(test2.tensors[1], test.tensors[1])


@pytest.mark.parametrize("path,message", [("/no/such.npz", "does not exist"), ("/etc/hostname", "neither an .npz")])
def test_bad_data_paths(path, message):
    with pytest.raises(DdplabError, match=message):
        load_images(path, 0)


def _run(tmp_path, name, n, *args):
    settings = [
        "trainer.progress=false", "log.tensorboard=false", "model.replicates=2", "trainer.max_steps=20",
        "analysis.measure_every=5", "analysis.fractions=[0.2,0.5,0.8]", *args,
    ]  # fmt: skip
    run_target("alignment_stats", tmp_path, name, *settings, n=n)
    return dict(np.load(tmp_path / "alignment_stats" / name / "results" / "alignment_stats.npz"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_give_the_single_process_analyses(tmp_path):
    one = _run(tmp_path, "one", 1, "analysis.plots=false")
    two = _run(tmp_path, "two", 2)
    # Layout: per-rank replicates of each measurement, layer by layer.
    assert list(two["steps"]) == [0, 5, 10, 15]
    assert two["alignment_layer0"].shape == (4, 2, 2, 100) and one["alignment_layer0"].shape == (4, 1, 2, 100)
    assert two["alignment_layer3"].shape == (4, 2, 2, 10)
    assert two["targeted_dropout"].shape == (3, 4, 3, 2, 2) and two["eigen_dropout"].shape == (2, 4, 3, 2, 2)
    for key in ("targeted_dropout", "eigen_dropout", "eigenvalues_layer1", "eigenvalues_layer3", "delta_norm_layer2"):
        np.testing.assert_allclose(two[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert list(two["train_steps"]) == [10, 20] and two["train_acc"].shape == (2,)
    plots = {p.name for p in (tmp_path / "alignment_stats" / "two" / "results").glob("*.png")}
    assert plots == {"curves.png", "alignment.png", "targeted_dropout.png", "eigenspectra.png", "eigen_dropout.png"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cnn_variant_end_to_end(tmp_path):
    out = _run(tmp_path, "cnn", 2, "model.kind=cnn", "analysis.plots=false", "trainer.max_steps=6")
    assert out["alignment_layer0"].shape[1:] == (2, 2, 8) and out["eigenvalues_layer1"].shape == (2, 72)
    # eigenfeature dropout acts on fully connected inputs
    assert list(out["eigen_dropout_layers"]) == [2]
