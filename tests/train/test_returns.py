"""What the experiment's methods and its networks return, read the way users write them
(train/returns.py): tensors, tuples, lists, dicts, dataclasses and transformers' ModelOutput."""

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from ddplab.errors import ConfigError
from ddplab.train.returns import call_with_inputs, logits_of, per_sample, split_output

W = torch.ones((), requires_grad=True)


@dataclass
class Output:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def _model_output(**fields):
    transformers = pytest.importorskip("transformers.modeling_outputs")
    return transformers.CausalLMOutputWithCrossAttentions(**fields)


def test_the_loss_is_found_where_each_kind_of_output_keeps_it():
    loss, logits = W * 2, torch.randn(2, 5, 7)
    for out in (loss, {"loss": loss}, Output(loss, logits), (logits, loss), [loss, logits]):
        assert split_output(out)[0] is loss
    # nanoGPT's namedtuple-free (logits, loss); a namedtuple is a tuple
    pair = namedtuple("Pair", "logits loss")(logits, loss)
    assert split_output(pair)[0] is loss


def test_a_models_own_output_logs_no_logits_while_a_users_dict_logs_its_scalars():
    loss, logits = W * 2, torch.randn(2, 5, 7)
    assert split_output(_model_output(loss=loss, logits=logits)) == (loss, {})
    assert split_output({"loss": loss, "acc": torch.tensor(0.5), "n": 3, "name": "x"})[1].keys() == {"acc", "n"}
    assert split_output(Output(loss, logits))[1].keys() == {"logits"}


@pytest.mark.parametrize(
    "out, said",
    [
        ((torch.randn(3), W * 1, W * 2), "a tuple of tensor(3,), tensor(), tensor()"),
        (Output(None, torch.randn(2)), "a Output with 'loss', 'logits'"),
        ({"logits": torch.randn(2)}, "a dict with 'logits'"),
        ("loss", "'loss'"),
    ],
)
def test_an_output_without_one_loss_is_one_line_saying_what_came_back(out, said):
    with pytest.raises(ConfigError, match=r"training_step returned (.*): no one-element loss in it") as e:
        split_output(out)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_default_predict_step_finds_the_logits_or_says_what_to_write():
    logits = torch.randn(2, 3)
    for out in (logits, (logits, None), [logits, W], {"logits": logits}, Output(W, logits)):
        assert logits_of(out, "net") is logits
    assert logits_of(_model_output(logits=logits), "model") is logits
    with pytest.raises(ConfigError, match=r"network 'net' returns, and it returned a dict with 'hidden'.*predict_step"):
        logits_of({"hidden": logits}, "net")


class OneTensor(torch.nn.Module):
    def forward(self, x):
        return x * 2


class Tokens(torch.nn.Module):
    """A transformers model's way: named inputs, the rest optional."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        return input_ids * (1 if attention_mask is None else attention_mask)


def test_the_default_predict_step_hands_a_dict_batch_by_the_names_forward_takes_or_says_what_to_write():
    x, mask = torch.randn(3, 4), torch.zeros(3, 4)
    # a dataset of dicts whose entries are named as forward's arguments, labels under another name
    assert torch.equal(call_with_inputs(OneTensor(), {"x": x, "label": torch.ones(3)}, "net"), x * 2)
    assert torch.equal(call_with_inputs(Tokens(), {"input_ids": x, "attention_mask": mask, "y": x}, "model"), x * 0)
    # inputs, (inputs, targets)
    assert torch.equal(call_with_inputs(OneTensor(), (x, torch.ones(3)), "net"), x * 2)
    assert torch.equal(call_with_inputs(OneTensor(), x, "net"), x * 2)
    # a dict forward cannot take: one line, not forward()'s TypeError
    with pytest.raises(ConfigError, match=r"to net \(OneTensor\).*forward needs x while the batch has features, label"):
        call_with_inputs(OneTensor(), {"features": x, "label": torch.ones(3)}, "net")


def test_per_sample_outputs_may_be_a_dataclass_and_a_batch_number_is_named():
    rows = torch.randn(4)
    assert per_sample(Output(rows, rows), "evaluation_step") == {"loss": rows, "logits": rows}
    with pytest.raises(ConfigError, match=r"its 'loss' is one number for the whole batch, not one row per sample"):
        per_sample(_model_output(loss=rows.mean(), logits=torch.randn(4, 2)), "evaluation_step")
