"""`ddplab predict`: a trained run's outputs for every input row, in input order, the same bytes on
any number of processes; the default predict_step of a classifier; BBBP on a CSV of SMILES."""

import csv
import json

import pytest
import torch

from ddplab.checkpoint.store import load_state
from helpers import ddplab_here

pytestmark = pytest.mark.timeout(60)
EXP = "tests/fixtures/experiments.py:Classifier"
QUIET = ["trainer.progress=false", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Classifier trained for 8 steps in one process (its eval set has 301 samples: uneven shards
    when the predictions are made on 2 or 3)."""
    tmp = tmp_path_factory.mktemp("predict")
    ddplab_here(
        "run",
        EXP,
        f"run.dir={tmp}",
        "run.name=c",
        "trainer.max_steps=8",
        "trainer.global_batch_size=32",
        *QUIET,
        expect=0,
    )
    return tmp / "classifier" / "c"


def predict(run, out, *args):
    """`ddplab predict`; on one process (-n 1 or none) in this one."""
    args, n = list(args), "1"
    if "-n" in args:
        at = args.index("-n")
        n = args[at + 1]
        del args[at : at + 2]
    command = ["predict", str(run), "--out", str(out), *args]
    res = ddplab_here(*command, *([] if n == "1" else ["-n", n]))
    assert res.returncode == 0, res.stderr
    return out.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_row_once_in_input_order_and_the_same_bytes_on_1_2_and_3_processes(run, tmp_path):
    outs = {n: predict(run, tmp_path / f"p{n}.csv", "--input", "eval", "-n", n) for n in ("1", "2", "3")}
    assert outs["1"] == outs["2"] == outs["3"]
    rows = list(csv.DictReader(outs["1"].decode().splitlines()))
    # the eval set, as the experiment builds it
    from fixtures.experiments import _dataset

    x, _ = _dataset(301, 1, torch.float32).tensors
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.0), torch.nn.Linear(16, 2))
    net.load_state_dict(load_state(str(run / "checkpoints" / "step-00000008"))["models"]["net"])
    with torch.no_grad():
        probs = net(x).softmax(-1)
    # the classifier default
    assert len(rows) == 301 and list(rows[0]) == ["label", "probability"]
    assert [int(r["label"]) for r in rows] == probs.argmax(-1).tolist()
    assert [float(r["probability"]) for r in rows] == pytest.approx(probs.amax(-1).tolist(), abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jsonl_and_a_checkpoint_folder_and_the_training_set_by_name(run, tmp_path):
    out = predict(run / "checkpoints" / "step-00000008", tmp_path / "t.jsonl", "--input", "train", "-n", "2")
    rows = [json.loads(line) for line in out.decode().splitlines()]
    assert len(rows) == 512 and set(rows[0]) == {"label", "probability"} and rows[0]["label"] in (0, 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, says",
    [
        # 10 batches of the run's micro-batch, 32 (its global batch on one process)
        (
            ["--input", "eval", "fault.predict_batch_mean=true", "-n", "2"],
            "predict_step must return one row per sample: it gave {'mean': 10} rows for 301 samples",
        ),
        (["--input", "dev"], "Classifier has no dataset named 'dev' to predict on (it has train, eval)"),
    ],
)
def test_a_broken_contract_or_an_unknown_dataset_is_one_line(run, tmp_path, args, says):
    command = ["predict", str(run), "--out", str(tmp_path / "x.csv"), *args]
    res = ddplab_here(*command)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "x.csv.tmp").exists()


@pytest.mark.parametrize(
    "where, out, says",
    [
        ("run", "x.txt", "--out x.txt: predictions are written as CSV or JSON lines; name it FILE.csv or FILE.jsonl"),
        ("tmp", "x.csv", "is not in a run folder that names its experiment (run.json)"),
    ],
)
def test_an_output_of_another_kind_or_a_folder_that_is_not_a_run_is_refused_before_launch(
    run, tmp_path, where, out, says
):
    res = ddplab_here(
        "predict",
        str(run if where == "run" else tmp_path),
        "--input",
        "eval",
        "--out",
        out,
        "-n",
        "2",
        cwd=str(tmp_path),
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_bbbp_predicts_a_csv_of_smiles_the_same_on_1_and_2_processes(tmp_path):
    small = ["model.hidden=16", "model.embedding_dim=16", "model.num_layers=1", "trainer.max_steps=2", *QUIET]
    # trained in one process: the predictions on 1 and 2 are what is compared
    ddplab_here("run", "bbbp", f"run.dir={tmp_path}", "run.name=b", *small, expect=0)
    from ddplab.experiments.smiles import BUNDLED_CSV

    with open(BUNDLED_CSV, newline="") as f:
        molecules = [row["smiles"] for row in csv.DictReader(f)][:45]
    (tmp_path / "mols.csv").write_text("smiles\n" + "\n".join(molecules) + "\n")
    run = tmp_path / "bbbp" / "b"
    one, two = (predict(run, tmp_path / f"{n}.csv", "--input", str(tmp_path / "mols.csv"), "-n", n) for n in "12")
    rows = list(csv.DictReader(one.decode().splitlines()))
    assert one == two and len(rows) == 45 and list(rows[0]) == ["p_np", "probability"]
    (tmp_path / "gap.csv").write_text("name,smiles\nethanol,CCO\nunknown,\nethylamine,CCN\n")
    res = ddplab_here("predict", str(run), "--input", str(tmp_path / "gap.csv"), "--out", str(tmp_path / "g.csv"))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"ddplab: error: {tmp_path / 'gap.csv'} line 3 has an empty SMILES (1 such rows); fill or remove those rows: "
        "each input row gets one prediction"
    ]
