"""dist.strategy=fsdp's parts that need no process group: which modules become units (by size, by
class), tied parameters kept in one unit, and the refusals made before anything is sharded."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from ddplab.config import DistConfig
from ddplab.distributed import fsdp
from ddplab.errors import ConfigError
from fixtures.model_families import TinyGPT


def _names(model: nn.Module, units: str, min_params: int = 1) -> list[str]:
    paths = {id(m): name for name, m in model.named_modules()}
    return [paths[id(m)] for m in fsdp.choose_units(model, units, min_params)]


def test_the_size_policy_makes_units_bottom_up_and_never_splits_a_tie():
    model = TinyGPT(width=16)
    # the embedding and the head share one weight: neither is a unit, the root holds both
    by_size = _names(model, "auto", min_params=800)
    assert "wte" not in by_size and "lm_head" not in by_size
    # the attention and the MLP's layers pass the threshold alone; the rest of the block then falls short
    assert by_size == ["block.attn", "block.mlp.0", "block.mlp.2"]
    # a threshold the whole block reaches only together: the block is one unit
    assert _names(model, "auto", min_params=3000) == ["block"]
    assert _names(model, "auto", min_params=10**9) == []


def test_units_named_by_class_children_first():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.outer = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))

    assert _names(Deep(), "Sequential") == ["outer.1", "outer"]
    assert _names(TinyGPT(), " Block , LayerNorm ") == ["ln_f", "block.ln_2", "block.ln_1", "block"]


def test_a_class_that_names_no_module_is_one_line_listing_the_modules():
    with pytest.raises(ConfigError) as e:
        fsdp.check_named_units({"model": TinyGPT()}, "TransformerBlock")
    assert "dist.fsdp_units=TransformerBlock names no module of the networks" in e.value.cause
    assert "Block" in e.value.cause and "Embedding" in e.value.cause
    # one misspelt class beside one that exists: named, not dropped
    with pytest.raises(ConfigError) as e:
        fsdp.check_named_units({"model": TinyGPT()}, "Block,Linearr")
    assert "dist.fsdp_units=Block,Linearr names Linearr, which no network has" in e.value.cause
    # one network may lack a class another has; auto names none
    fsdp.check_named_units({"model": TinyGPT(), "head": nn.Conv2d(2, 2, 1)}, "Block,Conv2d")
    fsdp.check_named_units({"head": nn.Linear(2, 2)}, "auto")
    assert fsdp.choose_units(nn.Linear(2, 2), "Block", 1) == []


def test_a_unit_that_would_split_a_tie_is_refused_naming_both_ends():
    with pytest.raises(ConfigError) as e:
        fsdp.choose_units(TinyGPT(), "Embedding", 1)
    assert "wte a unit of its own, but its parameter wte.weight is tied to lm_head.weight" in e.value.cause
    assert "dist.fsdp_units=auto" in e.value.fix


def test_offload_on_the_cpu_is_refused_before_sharding():
    with pytest.raises(ConfigError, match="this job trains on the CPU"):
        fsdp.shard(nn.Linear(4, 4), DistConfig(strategy="fsdp", fsdp_cpu_offload=True), torch.device("cpu"), "fp32")


def test_an_optimizer_made_in_build_follows_the_parameters_sharding_replaced():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}])
    places = fsdp.parameter_places(model)
    # what fully_shard does: a new parameter object in the same place
    model[1].weight = nn.Parameter(model[1].weight.detach().clone())
    moved = fsdp.replaced(places)
    fsdp.retarget([opt], moved)
    assert opt.param_groups[1]["params"][0] is model[1].weight
    assert opt.param_groups[0]["params"][0] is model[0].weight and opt.param_groups[1]["lr"] == 0.5


def test_a_run_that_shards_nothing_never_imports_fsdp_or_dcp():
    """Importing FSDP, DTensor and torch.distributed.checkpoint costs every process about half a
    second (1.5 s -> 2.2 s to import the training stack): only a sharded run pays it."""
    heavy = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"]
    code = (
        "import sys, ddplab.train.loop, ddplab.launch.worker, ddplab.launch.cli; "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
