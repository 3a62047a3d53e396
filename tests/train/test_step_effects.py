"""What the loop does to a training run, checked against what PyTorch says it must be: the dtype
autocast gives, the size of a clipped SGD update, a NaN caught with no checkpoint to catch it,
and the best checkpoint's weights as the exported model. Each expected value comes from torch's
own semantics or from a script, never from ddplab's code."""

import json
import shlex

import pytest
import torch
from safetensors.torch import load_file

from helpers import clean_env, ddplab_here, metrics_rows, summary_of

COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32"]
pytestmark = pytest.mark.timeout(60)


def _run(tmp_path, target, *args, env=None, code=0):
    command = ["run", f"tests/fixtures/experiments.py:{target}", f"run.dir={tmp_path}", "run.name=r", *COMMON, *args]
    res = ddplab_here(*command, env=env)
    assert res.returncode == code, res.stdout + res.stderr
    return tmp_path / target.lower() / "r", res


def _logged(run, key):
    rows = metrics_rows(run)
    return [r[key] for r in rows if key in r]


@pytest.mark.parametrize("precision,expected", [("bf16", 1.0), ("fp32", 0.0)])
def test_precision_is_the_dtype_the_forward_runs_in(tmp_path, precision, expected):
    run, _ = _run(tmp_path, "Observed", "trainer.max_steps=4", "trainer.log_every=2", f"trainer.precision={precision}")
    assert _logged(run, "train/bf16") == [expected, expected]


def test_gradient_clipping_bounds_the_update_sgd_makes(tmp_path):
    """One SGD step (lr 0.2, momentum 0.9: the first step moves by lr * gradient) with the global
    gradient norm clipped to c moves the parameters by exactly lr * c."""
    clip = 1e-3
    run, _ = _run(tmp_path, "Observed", "trainer.max_steps=1", "trainer.log_every=1", f"trainer.grad_clip={clip}")
    before = torch.load(run / "results" / "initial.pt", weights_only=True)
    after = load_file(run / "final" / "model.safetensors")
    step = torch.cat([(after[k].double() - before[k].double()).flatten() for k in before])
    # the clip was active
    assert _logged(run, "train/grad_norm")[0] > 10 * clip
    assert step.norm().item() == pytest.approx(0.2 * clip, rel=1e-4)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_nan_is_caught_by_the_periodic_check_alone(tmp_path):
    """No checkpoint is ever saved, so only the cross-rank flag in the heartbeat can stop the run."""
    _, res = _run(
        tmp_path,
        "Classifier",
        "-n",
        "2",
        "trainer.max_steps=3000",
        "checkpoint.at_end=false",
        "fault.nan_at_step=5",
        code=2,
    )
    assert "the loss is not a finite number (NaN or inf) at step 5 on rank 1" in res.stderr
    assert not (tmp_path / "classifier" / "r" / "final" / "model.safetensors").exists()


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_the_exported_model_is_the_best_checkpoint_after_load_best_checkpoint(tmp_path):
    """Scores per epoch 0.5, 0.9, 0.7, 0.6: the best is epoch 2's checkpoint, not the last one, and
    every rank loads that one (each rank looking for itself could find another)."""
    env = clean_env(SCRIPTED_SCORES="0.5,0.9,0.7,0.6")
    run, _ = _run(
        tmp_path,
        "ScriptedScore",
        "-n",
        "2",
        "trainer.max_epochs=4",
        "checkpoint.every_epoch=true",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=1",
        "checkpoint.monitor=score",
        env=env,
    )
    metas = {p.parent.name: json.loads(p.read_text()) for p in (run / "checkpoints").glob("step-*/meta.json")}
    best = max(metas, key=lambda name: metas[name]["metric"])
    last = max(metas, key=lambda name: metas[name]["step"])
    assert metas[best]["metric"] == 0.9 and metas[best]["epoch"] == 2 and best != last
    exported = load_file(run / "final" / "model.safetensors")
    held = [torch.load(run / "results" / f"params-rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, expected in ((best, True), (last, False)):
        saved = torch.load(run / "checkpoints" / name / "state.pt", weights_only=True)["models"]["net"]
        for weights in (exported, *held):
            # the export, and what each rank holds after loading the best
            assert all(torch.equal(saved[k], weights[k]) for k in saved) is expected, name


def test_every_epoch_sees_every_sample_once_in_a_new_order(tmp_path):
    run, _ = _run(tmp_path, "Observed", "trainer.max_epochs=3", "data.n_train=64", "trainer.global_batch_size=16")
    steps = torch.load(run / "results" / "seen-rank0.pt")
    epochs = [[x for step in steps[e * 4 : (e + 1) * 4] for x in step] for e in range(3)]
    dataset = sorted(epochs[0])
    # epoch 0: 64 distinct samples, each once
    assert len(set(dataset)) == 64
    for order in epochs[1:]:
        # every epoch: the same samples, each once
        assert sorted(order) == dataset
    # ... in a new order each epoch
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_every_rank_loads_the_best_checkpoint_even_the_one_still_being_written(tmp_path):
    """The last epoch scores best and its save is slow, and no log line is pending at the end (no
    collective holds rank 1 back): rank 1 reaches the end while rank 0 still writes that
    checkpoint, yet both must load it, not the best that rank 1 could see at that moment."""
    env = clean_env(SCRIPTED_SCORES="0.5,0.6,0.7,0.9")
    run, _ = _run(
        tmp_path,
        "ScriptedScore",
        "-n",
        "2",
        "trainer.max_epochs=4",
        "checkpoint.every_epoch=true",
        "checkpoint.keep_best=1",
        "checkpoint.monitor=score",
        "fault.slow_save_s=2",
        "trainer.log_every=16",
        env=env,
    )
    best = torch.load(run / "checkpoints" / "step-00000064" / "state.pt", weights_only=True)["models"]["net"]
    for rank in (0, 1):
        held = torch.load(run / "results" / f"params-rank{rank}.pt", weights_only=True)
        assert all(torch.equal(best[k], held[k]) for k in best), rank


def _stops(res):
    return [line for line in res.stdout.splitlines() if "early stop" in line]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_early_stopping_is_decided_once_for_every_rank_and_a_rerun_does_not_train_on(tmp_path):
    """Scores by epoch (max, min_delta 0.1, patience 2): 0.5 best, 0.55 too small a gain, 0.7 best,
    0.75 and 0.6 no gain: the run stops after epoch 5, at step 20 (4 steps an epoch). Rank 1's
    own script would stop at epoch 3: had it decided alone, the ranks would part ways and hang."""
    env = clean_env(
        SCRIPTED_SCORES="0.5,0.55,0.7,0.75,0.6,0.9,0.9,0.9", SCRIPTED_SCORES_RANK1="0.5,0.4,0.3,0.2,0.1,0.1,0.1,0.1"
    )
    args = [
        "-n",
        "2",
        "trainer.max_epochs=8",
        "trainer.global_batch_size=128",
        "trainer.early_stop.monitor=score",
        "trainer.early_stop.mode=max",
        "trainer.early_stop.patience=2",
        "trainer.early_stop.min_delta=0.1",
    ]
    run, res = _run(tmp_path, "ScriptedScore", *args, env=env)
    assert _stops(res) == [
        "early stop at step 20: eval score has not improved on 0.7 (step 12) for 2 evaluations "
        "(trainer.early_stop.patience)"
    ]
    assert _logged(run, "eval/score") == [0.5, 0.55, 0.7, 0.75, 0.6]
    assert json.loads((run / "checkpoints" / "step-00000020" / "meta.json").read_text())["step"] == 20
    assert (run / "final" / "model.safetensors").exists()
    assert summary_of(run)["status"] == "stopped early"

    # the same command: nothing more to train
    _, again = _run(tmp_path, "ScriptedScore", *args, env=env)
    assert _stops(again) == _stops(res) and "resumed from" in again.stdout
    # no evaluation, no step after 20
    assert _logged(run, "eval/score") == [0.5, 0.55, 0.7, 0.75, 0.6]

    # On purpose: more patience. The record (best 0.7 at step 12, 2 evaluations since) came back with the
    # checkpoint; this process's script starts again at 0.5 and 0.55, no gain on 0.7: 2 more epochs.
    _, on = _run(tmp_path, "ScriptedScore", *args, "trainer.early_stop.patience=4", env=env)
    assert _stops(on) == [
        "early stop at step 28: eval score has not improved on 0.7 (step 12) for 4 evaluations "
        "(trainer.early_stop.patience)"
    ]


def test_an_early_stop_metric_the_evaluation_never_returns_is_one_line(tmp_path):
    _, res = _run(tmp_path, "Classifier", "trainer.max_steps=2", "trainer.early_stop.monitor=acuracy", code=2)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "trainer.early_stop.monitor='acuracy' is not a metric the evaluation returns" in lines[0]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_every_run_ends_with_its_summary_and_the_commands_it_prints_work(tmp_path):
    run, res = _run(
        tmp_path,
        "Classifier",
        "-n",
        "2",
        "trainer.max_steps=8",
        "checkpoint.monitor=accuracy",
        "data.tokens_per_sample=7",
        "trainer.log_every=2",
    )
    summary = summary_of(run)
    assert (
        summary["status"] == "finished" and summary["step"] == 8 and summary["final"] and summary["samples_per_s"] > 0
    )
    # tokens/s: both ranks' tokens over the time samples/s is over (rank 0 counts in a tensor, rank 1 an int)
    for tokens, samples in zip(_logged(run, "train/tokens_per_s"), _logged(run, "train/samples_per_s"), strict=True):
        assert tokens == pytest.approx(7 * samples, rel=1e-9)
    # no GPU memory on the CPU; each rank's resident set (torch alone takes a few hundred MiB)
    assert 0 <= summary["data_wait"] < 1 and summary["peak_mem_gib"] is None
    assert len(summary["peak_rss_gib"]) == 2 and all(0.1 < gib < 16 for gib in summary["peak_rss_gib"])
    rss = ", ".join(f"{gib:.2f}" for gib in summary["peak_rss_gib"])
    assert f"  peak memory per rank: resident {rss} GiB\n" in res.stdout
    assert f"samples/s ({summary['tokens_per_s']:.1f} tokens/s) in training, " in res.stdout
    assert summary["plan"]["world_size"] == 2 and summary["best"]["step"] == 8
    assert summary["best"]["value"] == summary["last_eval"]["accuracy"] == _logged(run, "eval/accuracy")[-1]
    printed = dict(
        line.strip().split(": ", 1)
        for line in res.stdout.splitlines()
        if line.startswith(("  resume: ", "  evaluate: ", "  report: "))
    )
    # what the run printed is what it wrote
    assert printed == summary["commands"]
    evaluated = ddplab_here(*shlex.split(printed["evaluate"])[1:])
    assert evaluated.returncode == 0 and json.loads(evaluated.stdout) == summary["last_eval"], evaluated.stderr
    assert ddplab_here(*shlex.split(printed["report"])[1:]).returncode == 0
    # and train on
    resumed = ddplab_here(*shlex.split(printed["resume"])[1:], "trainer.max_steps=10")
    assert "at step 8" in resumed.stdout and summary_of(run)["step"] == 10
