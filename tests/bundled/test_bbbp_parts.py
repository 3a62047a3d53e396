"""BBBP building blocks: tokenizer, CSV reading, splits, and the LSTM's packed-sequence equivalence."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ddplab.errors import DdplabError
from ddplab.experiments import smiles
from ddplab.experiments.bbbp import SmilesClassifier
from ddplab.experiments.lstm import PackedBiLSTM


def test_byte_tokenizer_round_trips_and_reserves_zero_for_padding():
    text = "C1=CC=CC=C1[Na+].Cl"
    ids = smiles.encode(text, 512)
    assert min(ids) >= 1 and max(ids) < smiles.VOCAB_SIZE and len(ids) == len(text)
    assert smiles.decode(ids + [smiles.PAD_ID] * 3) == text
    assert len(smiles.encode(text, 5)) == 5


def test_collate_pads_with_zero_and_keeps_lengths():
    batch = smiles.collate([(torch.tensor([5, 6, 7]), 1.0), (torch.tensor([9]), 0.0)])
    assert batch["tokens"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["lengths"].tolist() == [3, 1] and batch["label"].tolist() == [1.0, 0.0]


def test_bundled_csv_and_stratified_splits():
    mols = smiles.read_csv(smiles.BUNDLED_CSV)
    assert len(mols.smiles) == 2050 and sum(mols.labels) == 1567 and not mols.skipped
    train, dev, held = smiles.stratified_splits(mols.labels, 0.1, 0.2, seed=0)
    assert len(held) == 205 and len(dev) == 369 and len(train) == 1476
    assert not (set(train) & set(dev) or set(train) & set(held) or set(dev) & set(held))
    y = np.asarray(mols.labels)
    for part in (train, dev, held):
        # the class balance is kept in every split
        assert abs(y[part].mean() - y.mean()) < 0.01
    again = smiles.stratified_splits(mols.labels, 0.1, 0.2, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip((train, dev, held), again, strict=True))


def test_empty_smiles_rows_are_skipped_and_reported(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("num,name,p_np,smiles\n1,a,1,CCO\n2,b,0,\n3,c,0,CCN\n4,d,1,  \n")
    mols = smiles.read_csv(str(path))
    assert mols.smiles == ["CCO", "CCN"] and mols.labels == [1, 0] and mols.skipped == [3, 5]


@pytest.mark.parametrize(
    "content,message",
    [
        ("name,label\nx,1\n", "no column(s) ['smiles', 'p_np']"),
        ("smiles,p_np\nCCO,yes\nCC,0\n", "line 2: p_np is 'yes'"),
        ("smiles,p_np\nCCO,1\nCC,1\n", "not both classes"),
    ],
)
def test_malformed_csv_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(
        DdplabError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        smiles.read_csv(str(path))


def test_missing_data_file():
    with pytest.raises(DdplabError, match=r"does not exist"):
        smiles.read_csv("/no/such/file.csv")


def test_lstm_equals_torch_packed_bidirectional_lstm():
    torch.manual_seed(0)
    ref = nn.LSTM(8, 16, num_layers=3, bidirectional=True, batch_first=True).double()
    ours = PackedBiLSTM(8, 16, 3, dropout=0.0).double()
    for layer in range(3):
        # same weights, laid out per direction
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(ours.forward_layers[layer], f"{name}_l0").data.copy_(getattr(ref, f"{name}_l{layer}"))
            getattr(ours.backward_layers[layer], f"{name}_l0").data.copy_(getattr(ref, f"{name}_l{layer}_reverse"))
    lengths = torch.tensor([7, 3, 5, 1])
    x = torch.randn(4, 7, 8, dtype=torch.float64)
    for i, n in enumerate(lengths):
        # padding garbage that must not leak into any state
        x[i, n:] = 1e3
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    out_ref, (h_n, _) = ref(packed)
    out_ref, _ = nn.utils.rnn.pad_packed_sequence(out_ref, batch_first=True)
    out, final = ours(x, lengths)
    assert torch.allclose(final, torch.cat([h_n[-2], h_n[-1]], dim=1), atol=1e-12)
    for i, n in enumerate(lengths):
        assert torch.allclose(out[i, :n], out_ref[i, :n], atol=1e-12)


def test_classifier_uses_both_directions():
    """Perturbing either direction's last layer changes the logit: neither is ignored or duplicated."""
    torch.manual_seed(0)
    net = SmilesClassifier(embedding_dim=8, hidden=4, num_layers=2, dropout=0.0).eval()
    tokens, lengths = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]]), torch.tensor([3, 2])
    base = net(tokens, lengths).detach()
    assert base.shape == (2,) and net.head[0].in_features == 2 * 4
    for layers in (net.lstm.forward_layers, net.lstm.backward_layers):
        with torch.no_grad():
            layers[-1].weight_hh_l0.add_(0.5)
            assert not torch.allclose(net(tokens, lengths), base)
            layers[-1].weight_hh_l0.sub_(0.5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bbbp_end_to_end_on_two_ranks(tmp_path):
    from helpers import ddplab_here, metrics_rows

    res = ddplab_here(
        "run",
        "bbbp",
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=e2e",
        "trainer.max_epochs=2",
        "model.embedding_dim=16",
        "model.hidden=16",
        "model.num_layers=1",
        "data.max_len=64",
        "trainer.progress=false",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    # the run summary follows
    last = next(line for line in res.stdout.splitlines() if line.startswith("bbbp: heldout"))
    assert last.startswith("bbbp: heldout ROC AUC 0.") and f"run dir {tmp_path}/bbbp/e2e" in last
    run = tmp_path / "bbbp" / "e2e"
    rows = metrics_rows(run)
    assert sum("eval/roc_auc" in r for r in rows) == 2 and any("heldout/roc_auc" in r for r in rows)
    assert any(p.name.startswith("events.out") for p in (run / "tensorboard").rglob("*"))
    # The exported model is the best dev epoch's checkpoint, chosen here from the checkpoints' own records ...
    metas = [json.loads(m.read_text()) | {"dir": m.parent} for m in (run / "checkpoints").glob("step-*/meta.json")]
    best = max(metas, key=lambda m: m["metric"])
    saved = torch.load(best["dir"] / "state.pt", weights_only=True)["models"]["net"]
    exported = load_file(run / "final" / "model.safetensors")
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)
    # ... and the heldout ROC AUC it reports is scikit-learn's, of that model on the heldout split.
    from sklearn.metrics import roc_auc_score

    from ddplab import load_model

    mols = smiles.read_csv(smiles.BUNDLED_CSV)
    heldout = smiles.SmilesDataset(mols, smiles.stratified_splits(mols.labels, 0.1, 0.2, 0)[2], 64)
    batch = smiles.collate([heldout[i] for i in range(len(heldout))])
    with torch.no_grad():
        prob = torch.sigmoid(load_model(str(run))(batch["tokens"], batch["lengths"]).double())
    reported = float(last.split("heldout ROC AUC ")[1].split()[0])
    assert reported == pytest.approx(roc_auc_score(batch["label"].numpy(), prob.numpy()), abs=6e-5)


def test_a_csv_with_a_byte_order_mark_reads_and_one_in_latin_1_is_one_line(tmp_path):
    """Spreadsheet programs write a byte-order mark before the header, and some write latin-1."""
    rows = "smiles,p_np\nCCO,1\nc1ccccc1,0\n"
    marked = tmp_path / "marked.csv"
    marked.write_bytes(b"\xef\xbb\xbf" + rows.encode())
    assert smiles.read_csv(str(marked)).smiles == ["CCO", "c1ccccc1"]
    assert smiles.read_unlabelled(str(marked)).smiles == ["CCO", "c1ccccc1"]
    latin = tmp_path / "latin.csv"
    latin.write_bytes("smiles,p_np,name\nCCO,1,éthanol\nc1ccccc1,0,benzène\n".encode("latin-1"))
    for read in (smiles.read_csv, smiles.read_unlabelled):
        with pytest.raises(DdplabError, match=r"latin.csv is not UTF-8 text .*; save the CSV as UTF-8") as refused:
            read(str(latin))
        assert "\n" not in str(refused.value)
