"""Programmatic dependent launch for the fused ops (ops/kernels/pdl.py): asked for, every Triton launch of a step
takes it and the tokens do not change; where the GPU lacks it (and on the CPU) the op set is the plain one."""

import dataclasses
import importlib
import pkgutil

import pytest
import test_ops_fused_model
import torch
from engine_helpers import tiny_llama, tiny_model
from test_engine_models import CONFIGS

from attnserve.ops import OpSet, kernels, select_ops, triton_ops
from attnserve.ops.kernels import pdl
from attnserve.ops.kernels.pdl import launch_options, pdl_applies

# every fused-op kernel module that launches through pdl.launch_options, found rather than listed
KERNEL_MODULES = tuple(
    module for module in (importlib.import_module(f"{kernels.__name__}.{info.name}")
                          for info in pkgutil.iter_modules(kernels.__path__))
    if module is not pdl and getattr(module, "launch_options", None) is launch_options)
MODELS = {"llama": lambda: tiny_llama(seed=4), "deepseek": lambda: tiny_model(CONFIGS["deepseek-v2-mla-moe"], seed=4)}


def test_the_pdl_op_set_hands_pdl_to_every_op():
    plain, ops = triton_ops(), triton_ops(pdl=True)
    assert ops.name == "triton+pdl"
    for field in dataclasses.fields(OpSet):
        op = getattr(ops, field.name)
        if callable(op):
            assert op.func is getattr(plain, field.name) and op.keywords == {"pdl": True}, field.name


def test_no_pdl_where_the_device_lacks_it():
    assert not pdl_applies(torch.device("cpu"))
    assert select_ops("cpu", pdl=True) == select_ops("cpu")
    assert launch_options(False) == {"PDL": False}  # no launch attribute at all when off
    assert launch_options(True) == {"PDL": True, "launch_pdl": True}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_fused_launch_of_a_step_asks_for_pdl(name, monkeypatch):
    """Each kernel module's launch options recorded (and PDL itself left off, so this runs anywhere): with the
    PDL op set, every launch in prefill and decode asks for it; the greedy tokens are those of the plain set."""
    bundle = MODELS[name]()
    plain_out, _ = test_ops_fused_model._run(bundle, fused=True)
    asked = []
    for module in KERNEL_MODULES:
        monkeypatch.setattr(module, "launch_options", lambda pdl: asked.append(pdl) or {"PDL": False})
    monkeypatch.setattr(test_ops_fused_model, "triton_ops", lambda: triton_ops(pdl=True))
    out, _ = test_ops_fused_model._run(bundle, fused=True, enable_pdl=True)  # the engine's own warm-up too
    assert out == plain_out
    assert len(asked) > 10 and all(asked)


@pytest.mark.skipif(not pdl_applies(torch.device("cuda")) if torch.cuda.is_available() else True,
                    reason="needs an SM90 or later GPU; test_every_fused_launch_of_a_step_asks_for_pdl covers the "
                    "plumbing on the CPU")
@pytest.mark.parametrize("name", list(MODELS))
def test_pdl_launches_give_the_same_tokens_and_logits(name, monkeypatch):
    bundle = MODELS[name]()
    plain_out, plain_logits = test_ops_fused_model._run(bundle, fused=True)
    monkeypatch.setattr(test_ops_fused_model, "triton_ops", lambda: triton_ops(pdl=True))
    out, logits = test_ops_fused_model._run(bundle, fused=True, enable_pdl=True)
    assert out == plain_out
    assert all(torch.equal(a, b) for a, b in zip(logits, plain_logits))
