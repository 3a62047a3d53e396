"""final/ of networks whose tensors are shared (checkpoint/export.py): each tensor written once, its
other names recorded the safetensors way, put back on load; views that overlap written as copies."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from safetensors.torch import load_model as safetensors_load_model
from torch import nn

import ddplab
from ddplab.checkpoint.export import one_copy_each, with_aliases
from ddplab.config import load_config
from ddplab.entries import load_entry
from helpers import FIXTURES


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.wte.weight
        # a view of part of a parameter, kept as a buffer; and an empty buffer
        self.register_buffer("first_row", self.wte.weight.data[0])
        self.register_buffer("nothing", torch.empty(0))
        self.register_buffer("nothing_else", torch.empty(0))


def test_a_tied_tensor_is_written_once_and_every_other_view_is_a_copy(tmp_path):
    net = Tied()
    tensors, aliases = one_copy_each(net.state_dict())
    assert aliases == {"head.weight": "wte.weight"}
    assert list(tensors) == ["first_row", "nothing", "nothing_else", "wte.weight"]
    # the partial view no longer shares memory with the tensor it looks into
    assert tensors["first_row"].untyped_storage().data_ptr() != net.wte.weight.untyped_storage().data_ptr()
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt", **aliases})
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        back = with_aliases(load_file(tmp_path / "m.safetensors"), f.metadata())
    fresh = Tied()
    fresh.load_state_dict(back, strict=True)
    assert torch.equal(fresh.head.weight, net.wte.weight) and fresh.head.weight is fresh.wte.weight
    # safetensors' own reader of shared tensors reads the file too
    other = nn.Sequential()
    other.wte, other.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    other.head.weight = other.wte.weight
    safetensors_load_model(other, tmp_path / "m.safetensors", strict=False)
    assert torch.equal(other.head.weight, net.wte.weight)


@pytest.mark.timeout(60)
def test_a_tied_model_with_a_moving_average_exports_the_average_with_its_ties(tmp_path):
    cls = load_entry(f"{FIXTURES / 'model_families.py'}:TiedGPT")
    settings = ["trainer.max_steps=4", "trainer.global_batch_size=16", "trainer.ema_decay=0.5", "run.name=r"]
    exp = cls(load_config(cls.config_class, [*settings, f"run.dir={tmp_path}", "trainer.progress=false"]))
    exp.fit()
    loaded = ddplab.load_model(exp.run_dir)
    assert loaded.lm_head.weight is loaded.wte.weight
    average = torch.load(f"{exp.run_dir}/checkpoints/step-00000004/state.pt", weights_only=True)["ema"]["model"]
    trained = exp.models["model"].state_dict()
    assert not torch.equal(average["lm_head.weight"], trained["lm_head.weight"])
    assert all(torch.equal(value, average[key]) for key, value in loaded.state_dict().items())


def test_an_experiment_file_loaded_twice_in_one_process_is_one_module(tmp_path):
    """Loaded again (a notebook building a run's experiment twice, `ddplab eval` after a fit), a file
    is the module it was: run a second time, it was a new module whose classes no checkpoint of the
    first one's would resume ("trained by experiment twice.Net, this run has ddplab_user_twice.Net")."""
    from ddplab.train.rundir import experiment_identity

    (tmp_path / "twice.py").write_text("class Net:\n    pass\n")
    first, again = load_entry(f"{tmp_path / 'twice.py'}:Net"), load_entry(f"{tmp_path / 'twice.py'}:Net")
    assert again is first and experiment_identity(again) == "twice.Net"
    # another file of the same name is another module, and hides neither
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "twice.py").write_text("class Net:\n    pass\n")
    assert load_entry(f"{tmp_path / 'other' / 'twice.py'}:Net") is not first
