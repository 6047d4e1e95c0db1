"""amp_C stand-ins as scripts call them: apex's C++ binding took ``float scale`` and pybind
converted a one-element tensor (``torch.tensor([s])``, Megatron-style ``clip_coeff`` tensors)
to it; an op fp16kit does not provide says which ones it does, under both names a script can
reach it by (``amp_C.<op>`` through the alias module, or the ``amp_C`` attribute)."""

from __future__ import annotations

import importlib

import pytest
import torch

from fp16kit.legacy.multi_tensor_apply import amp_C, multi_tensor_applier


@pytest.mark.parametrize("scale", [torch.tensor([0.25]), torch.tensor(0.25), torch.tensor([[0.25]])])
def test_scale_given_as_a_one_element_tensor(scale):
    srcs = [torch.randn(5).half(), torch.randn(2, 3).half()]
    dsts = [torch.empty(5), torch.empty(2, 3)]
    flag = torch.zeros(1, dtype=torch.int)
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [srcs, dsts], scale)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, s.float() * 0.25)
    assert flag.item() == 0


def test_a_scale_of_several_elements_is_refused_like_apex():
    flag = torch.zeros(1, dtype=torch.int)
    dst = [torch.zeros(3)]
    with pytest.raises((TypeError, ValueError), match="one-element|one element"):
        multi_tensor_applier(amp_C.multi_tensor_scale, flag, [[torch.ones(3)], dst], torch.tensor([1.0, 2.0]))
    assert torch.equal(dst[0], torch.zeros(3))


@pytest.mark.parametrize("name", ["multi_tensor_axpby", "multi_tensor_lamb", "multi_tensor_l2norm_scale"])
def test_ops_not_provided_name_the_ones_that_are(name):
    module = importlib.import_module("fp16kit.legacy.multi_tensor_apply")
    for holder in (amp_C, module):
        with pytest.raises(AttributeError, match=f"{name}.*multi_tensor_scale.*multi_tensor_l2norm"):
            getattr(holder, name)
    assert not hasattr(amp_C, "__wrapped__")  # other missing names stay plain AttributeErrors
