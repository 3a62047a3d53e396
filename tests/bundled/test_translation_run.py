"""The translation example end to end on 2 gloo ranks, and its evaluation equal on 1 and 2 ranks."""

import json

import pytest

from helpers import ddplab_here, metrics_rows, run_target

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
TINY = [
    "data.n_train=512",
    "data.n_valid=37",
    "model.d_model=32",
    "model.feedforward=64",
    "model.heads=2",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "trainer.global_batch_size=64",
    "trainer.max_steps=12",
    "trainer.log_every=4",
    "trainer.eval_every=6",
    "trainer.eval_batch_size=8",
    "trainer.progress=false",
    "log.tensorboard=false",
    "data.examples=2",
    "optim.warmup_steps=2",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("translation")
    res = ddplab_here("run", "translation", "-n", "2", f"run.dir={tmp}", "run.name=t", *TINY)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp / "translation" / "t", res.stdout


def test_trains_validates_by_decoding_and_checkpoints(trained):
    run_dir, out = trained
    rows = metrics_rows(run_dir)
    evals = [r for r in rows if "eval/cer" in r]
    assert [r["step"] for r in evals] == [6, 12]
    for r in evals:
        assert {"eval/loss", "eval/cer", "eval/wer", "eval/bleu", "eval/exact"} <= r.keys()
        assert 0.0 <= r["eval/bleu"] <= 1.0 and r["eval/cer"] >= 0.0
    # 2 examples per evaluation, printed once (rank 0)
    assert out.count("(reference '") == 4
    assert "translation: validation CER" in out
    assert (run_dir / "checkpoints" / "step-00000012" / "COMMITTED").exists()
    assert (run_dir / "final" / "model.safetensors").exists()
    assert json.loads((run_dir / "run.json").read_text())["world_size"] == 2


def test_decoding_evaluation_is_exact_on_any_number_of_ranks(trained, tmp_path):
    """37 validation sentences: shards of 19 and 18, gathered without duplicates or padding."""
    run_dir, _ = trained
    results = {}
    for n in (1, 2):
        out = tmp_path / f"eval{n}.json"
        res = ddplab_here("eval", "translation", "--checkpoint", str(run_dir), "--out", str(out), "-n", str(n), *TINY)
        assert res.returncode == 0, res.stdout + res.stderr
        results[n] = json.loads(out.read_text())
    assert results[1].keys() == {"loss", "sentences", "cer", "wer", "bleu", "exact"}
    # data.n_valid: none dropped, none twice
    assert results[1]["sentences"] == results[2]["sentences"] == 37
    for key in ("cer", "wer", "bleu", "exact"):
        # from the decoded strings: equal, not close
        assert results[1][key] == results[2][key], key
    # Summed over other batch compositions (shards of 19 and 18), the loss may differ in its last bits.
    assert results[1]["loss"] == pytest.approx(results[2]["loss"], rel=1e-6)


def test_a_run_shorter_than_the_warm_up_warms_up_for_a_tenth_of_it(tmp_path):
    """The example must run at any length: 20 steps with the default warm-up of 100."""
    settings = [s for s in TINY if not s.startswith(("optim.warmup_steps", "trainer.max_steps", "trainer.eval"))]
    run_target("translation", tmp_path, "s", *settings, "trainer.max_steps=20", n=1)
    rows = metrics_rows(tmp_path / "translation" / "s")
    rates = [row["train/lr"] for row in rows if "train/lr" in row]
    # 2 steps of warm-up, then the cosine decay: the rate logged at step 4 is already below the peak
    assert rates and max(rates) < 1e-3
