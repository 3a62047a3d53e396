"""Conformance of the model families users bring (tests/fixtures/model_families.py): each trains on
2 gloo ranks, resumes bit for bit after a SIGKILL, evaluates exactly (2 ranks give the metrics one
process gives), exports a final/ that loads strictly into the user's own class with its ties intact,
and predicts. Two runs per family (straight, and killed then resumed) serve every check."""

import inspect
import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import ddplab
from ddplab.entries import load_entry
from helpers import FIXTURES, ddplab_here, experiment_of, metrics_rows, run_target, summary_of

FAMILIES = {
    "TiedGPT": "TinyGPT",
    "HFGPT2": "gpt2",
    "BatchNormCNN": "SmallCNN",
    "FrozenFeatures": "SmallCNN",
    "UnusedHead": "TwoHeads",
    "LazyMLP": None,
    "GroupsMLP": "BodyAndHead",
    "SharedEmbedding": None,
}
COMMON = (
    "trainer.max_steps=8",
    "trainer.global_batch_size=16",
    "trainer.checkpoint_every=3",
    "trainer.progress=false",
    "log.tensorboard=false",
)
_RUNS: dict[str, tuple] = {}


def _target(family: str) -> str:
    return f"{FIXTURES / 'model_families.py'}:{family}"


def _needs(family: str) -> None:
    if family == "HFGPT2":
        pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e '.[test]')")


def _runs(family: str, tmp_path_factory) -> tuple:
    """(straight run folder, killed-and-resumed run folder, the resumed run's output), made once."""
    if family not in _RUNS:
        root = tmp_path_factory.mktemp(family)
        run_target(_target(family), root, "straight", *COMMON)
        # the last rank SIGKILLs itself before step 5; the agent restarts both from step 3's checkpoint
        resumed = run_target(_target(family), root, "killed", *COMMON, "die_at_step=5", "--max-restarts", "1")
        folder = root / family.lower()
        _RUNS[family] = (folder / "straight", folder / "killed", resumed.stdout)
    return _RUNS[family]


def _last_eval(run) -> dict:
    rows = metrics_rows(run)
    last = [row for row in rows if any(key.startswith("eval/") for key in row)][-1]
    return {key[5:]: value for key, value in last.items() if key.startswith("eval/")}


@pytest.mark.slow
@pytest.mark.timeout(320)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_killed_run_resumes_bit_for_bit_and_every_rank_holds_the_same_state(family, tmp_path_factory):
    _needs(family)
    straight, killed, output = _runs(family, tmp_path_factory)
    assert (killed / "died-once").exists() and "at step 3" in output, output
    final = torch.load(straight / "results" / "state-rank0.pt")
    for run in (straight, killed):
        for rank in (0, 1):
            state = torch.load(run / "results" / f"state-rank{rank}.pt")
            # parameters and buffers (BatchNorm's statistics) alike
            assert state.keys() == final.keys()
            assert all(torch.equal(state[key], final[key]) for key in final), (run.name, rank)
    assert summary_of(killed)["attempts"] == 2


@pytest.mark.slow
@pytest.mark.timeout(320)
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_evaluate_what_one_process_evaluates(family, tmp_path_factory):
    _needs(family)
    straight, _, _ = _runs(family, tmp_path_factory)
    one_process = experiment_of(_target(family), straight).evaluate_checkpoint(str(straight))
    two_ranks = _last_eval(straight)
    assert one_process.keys() == two_ranks.keys()
    # the same samples in batches cut elsewhere: equal to the last bits of float32 sums
    assert one_process == pytest.approx(two_ranks, rel=1e-6, abs=1e-9)


def _plain(family: str):
    """The user's own class, built as the user builds it, without ddplab."""
    families = inspect.getmodule(load_entry(_target(family)))
    name = FAMILIES[family]
    if family == "LazyMLP":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.LazyLinear(3))
    if family == "SharedEmbedding":
        embedding = torch.nn.Embedding(families.VOCAB, 16)
        return {"encoder": families.Encoder(embedding), "decoder": families.Decoder(embedding)}
    return getattr(families, name)()


@pytest.mark.slow
@pytest.mark.timeout(320)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_loads_strictly_into_the_users_class_with_its_ties(family, tmp_path_factory):
    _needs(family)
    straight, _, _ = _runs(family, tmp_path_factory)
    trained = torch.load(straight / "results" / "state-rank0.pt")
    loaded = ddplab.load_model(str(straight))
    networks = (
        loaded
        if isinstance(loaded, dict)
        else {next(iter(json.loads((straight / "final" / "meta.json").read_text())["networks"])): loaded}
    )
    plain = _plain(family)
    plain = plain if isinstance(plain, dict) else {next(iter(networks)): plain}
    for name, network in networks.items():
        state = network.state_dict()
        # the weights the run ended with, under every name they have
        assert all(torch.equal(state[key], trained[f"{name}.{key}"]) for key in state)
        plain[name].load_state_dict(state, strict=True)
    if family in ("TiedGPT", "HFGPT2"):
        net = next(iter(networks.values()))
        embedding = net.get_input_embeddings().weight if family == "HFGPT2" else net.wte.weight
        head = net.lm_head.weight
        assert head is embedding
        with torch.no_grad():
            embedding[0, 0] += 1.0
        assert head[0, 0] == embedding[0, 0]
        # written once, its other name recorded the safetensors way
        written = load_file(straight / "final" / "model.safetensors")
        assert len(written) == len(net.state_dict()) - 1
    if family == "SharedEmbedding":
        assert networks["encoder"].emb is networks["decoder"].emb
    if family == "FrozenFeatures":
        ddplab_seed = torch.load(straight / "results" / "state-rank0.pt")
        from ddplab import seeding

        seeding.seed_everything(0)
        initial = _plain(family).features.state_dict()
        assert all(
            torch.equal(ddplab_seed[f"net.features.{k}"], v)
            for k, v in initial.items()
            if "running" not in k and "num_batches" not in k
        )


@pytest.mark.slow
@pytest.mark.timeout(320)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_finished_run_predicts_one_row_per_sample(family, tmp_path_factory):
    _needs(family)
    straight, _, _ = _runs(family, tmp_path_factory)
    rows = experiment_of(_target(family), straight).predict_checkpoint(str(straight), "eval")
    assert rows and all(len(values) == 37 for values in rows.values())
    if "probability" in rows:
        assert ((rows["probability"] > 0) & (rows["probability"] <= 1)).all()


@pytest.mark.slow
@pytest.mark.timeout(320)
@pytest.mark.parametrize(
    "settings, said, fix",
    [
        ((), "aux.weight, aux.bias (on rank ", "dist.find_unused_parameters=true"),
        (("dist.static_graph=true",), "and dist.static_graph=true told DDP", "dist.static_graph=false"),
    ],
)
def test_a_parameter_some_steps_leave_unused_is_one_line_whose_fix_works(
    tmp_path, tmp_path_factory, settings, said, fix
):
    where = (f"run.dir={tmp_path}", "run.resume=never")
    res = ddplab_here(
        "run", _target("UnusedHead"), "-n", "2", *where, *COMMON, "dist.find_unused_parameters=false", *settings
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0] and fix in lines[0]
    # the fix the line names is the family's own setting, the one its straight run trained with
    straight, _, _ = _runs("UnusedHead", tmp_path_factory)
    key, value = fix.split("=")
    assert str(OmegaConf.select(OmegaConf.load(straight / "config.yaml"), key)).lower() == value
    assert (straight / "results" / "state-rank0.pt").exists()


@pytest.mark.timeout(60)
def test_a_parameter_the_first_step_leaves_unused_under_a_static_graph_is_one_line_whose_fix_works(tmp_path):
    where = (f"run.dir={tmp_path}", "run.resume=never", "dist.find_unused_parameters=false")
    res = ddplab_here("run", _target("LateHead"), "-n", "2", *where, *COMMON, "dist.static_graph=true")
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "got no gradient in the first step got one in this step" in lines[0], res.stderr
    assert "set dist.static_graph=false (and dist.find_unused_parameters=true)" in lines[0]
    fixed = ddplab_here("run", _target("LateHead"), "-n", "2", *where[:2], *COMMON, "dist.find_unused_parameters=true")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
