"""fp16kit.legacy.amp.casts: apex O1's casts on torch.autocast (docs/apex-amp.md §10, §12, §13.4,
§13.6), on CPU autocast (float16).

enable_o1 switches autocast on for the calling thread for good; every test that uses it leaves
through ``_disable_o1_for_tests`` (the ``o1`` fixture), and an autouse fixture checks that the
test thread's autocast state is what it was before each test.
"""

from __future__ import annotations

import collections
import copy
import importlib
import logging
import pickle
import threading
import types

import pytest
import torch
import torch.nn.functional as F

# Imported by name: works with or without fp16kit/legacy/amp/__init__.py (a namespace package).
casts = importlib.import_module("fp16kit.legacy.amp.casts")


def _autocast_state():
    torch.autocast_increment_nesting()
    nesting = torch.autocast_decrement_nesting()
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.is_autocast_cache_enabled(),
        nesting,
    )


@pytest.fixture(autouse=True)
def _autocast_state_restored():
    before = _autocast_state()
    yield
    after = _autocast_state()
    casts._disable_o1_for_tests()  # never leak O1 into the next test, even after a failure
    assert after == before, "the test left autocast in another state than it found it"


@pytest.fixture
def o1():
    casts.enable_o1("cpu")
    yield
    casts._disable_o1_for_tests()


@pytest.fixture
def registry(monkeypatch):
    """A clean registration queue, as before any amp.initialize."""
    monkeypatch.setattr(casts, "_pending", [])
    monkeypatch.setattr(casts, "_applied_once", False)
    return casts


def _nesting():
    return _autocast_state()[-1]


# ------------------------------------------------------------------------------- enable_o1


def test_enable_o1_casts_as_apex_on_cpu(o1):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out = lin(x)
    assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert out.dtype == torch.float16
    assert (x @ lin.weight).dtype == torch.float16
    assert torch.matmul(x, lin.weight).dtype == torch.float16
    assert F.conv2d(torch.randn(1, 3, 8, 8), torch.randn(2, 3, 3, 3)).dtype == torch.float16
    # losses: fp32, as in apex
    assert F.mse_loss(out, y).dtype == torch.float32
    assert F.cross_entropy(out, torch.tensor([0, 1, 2, 3])).dtype == torch.float32
    # CPU autocast (torch 2.13) has no fp32 policy for softmax/log_softmax; apex's lists have
    # (tests/legacy/amp/test_o1_lists.py covers every name)
    assert F.softmax(out, -1).dtype == torch.float32
    assert F.log_softmax(out, -1).dtype == torch.float32
    assert F.softmax(x, -1).dtype == torch.float32
    # fp32 params and their grads stay fp32
    F.mse_loss(lin(x), y).backward()
    assert lin.weight.dtype == lin.weight.grad.dtype == torch.float32


def test_enable_o1_is_idempotent(o1):
    level = _nesting()
    casts.enable_o1("cpu")
    casts.enable_o1("cpu")
    assert _nesting() == level
    assert torch.is_autocast_enabled("cpu")


def test_enable_o1_stays_on_after_inner_autocast_regions(o1):
    with torch.autocast("cpu", enabled=False):
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.bfloat16
    assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16


def test_disable_o1_for_tests_restores_the_previous_state():
    before = _autocast_state()
    casts.enable_o1("cpu")
    assert _autocast_state() != before
    casts._disable_o1_for_tests()
    assert _autocast_state() == before


def test_enable_o1_is_per_thread():
    seen = {}

    def worker():
        casts.enable_o1("cpu")
        seen["worker"] = torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype
        casts._disable_o1_for_tests()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == torch.float16
    assert not torch.is_autocast_enabled("cpu")
    assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_enable_o1_cuda_without_cuda_names_the_fix():
    with pytest.raises(RuntimeError, match="CUDA is not available.*device_type='cpu'"):
        casts.enable_o1("cuda")
    assert not torch.is_autocast_enabled("cuda")
    casts.enable_o1("cpu")  # the failed call recorded nothing
    assert torch.is_autocast_enabled("cpu")
    casts._disable_o1_for_tests()


# ------------------------------------------------------------------------------ the cache


def test_fp16_weights_changed_in_place_are_seen(o1):
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    first = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)
    # the O1 context is never left, so torch never clears autocast's cache on its own; apex's
    # lists cast linear's weights themselves and notice the in-place change (apex#796)
    assert not torch.equal(lin(x), first)


def test_clear_cache_drops_the_cached_fp16_weights(o1, caplog):
    # apex's per-cast lines (verbosity=2) show which casts happen
    casts.enable_o1("cpu", verbose=True)
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)

    def casts_made():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fp16kit.apex"):
            out = lin(x)
        return out, [r.getMessage() for r in caplog.records]

    out, made = casts_made()
    assert made == ["Float->Half (linear)"] * 3  # input, weight, bias
    again, made = casts_made()
    assert made == ["Float->Half (linear)"]  # the input; the params' copies are reused
    casts.clear_cache()
    third, made = casts_made()
    assert made == ["Float->Half (linear)"] * 3
    assert torch.equal(out, again) and torch.equal(out, third)


def test_clear_cache_after_forward(o1):
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    handle = casts.clear_cache_after_forward(lin)
    first = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)
    assert not torch.equal(lin(x), first)
    pickle.loads(pickle.dumps(lin))  # the hook is a module-level function
    copy.deepcopy(lin)
    handle.remove()
    assert not lin._forward_hooks


def test_clear_cache_after_forward_runs_when_forward_raises(o1):
    class Boom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            self.lin(x)
            raise ValueError("boom")

    model, x = Boom(), torch.randn(2, 4)
    casts.clear_cache_after_forward(model)
    with pytest.raises(ValueError):
        model(x)
    first = model.lin(x)
    casts.clear_cache()
    with torch.no_grad():
        model.lin.weight.mul_(2)
    assert not torch.equal(model.lin(x), first)


def test_clear_cache_without_o1():
    casts.clear_cache()


# --------------------------------------------------------------------------- disable_casts


def test_disable_casts_inside_o1(o1):
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with casts.disable_casts():
        assert not torch.is_autocast_enabled("cpu")
        assert lin(x).dtype == torch.float32
    assert torch.is_autocast_enabled("cpu")
    assert lin(x).dtype == torch.float16


def test_disable_casts_is_exception_safe(o1):
    level = _nesting()
    with pytest.raises(KeyError):
        with casts.disable_casts():
            raise KeyError("inside")
    assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert _nesting() == level
    assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float16


def test_disable_casts_without_o1():
    with casts.disable_casts():
        assert not torch.is_autocast_enabled("cpu")
        assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")


def test_disable_casts_restores_a_user_autocast_and_decorates():
    @casts.disable_casts()
    def run():
        return torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert run() == torch.float32
        with casts.disable_casts():
            pass
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


# ------------------------------------------------------------------------------ decorators


def _dtypes(*args, **kwargs):
    def of(x):
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(of(y) for y in x))
        if isinstance(x, (list, tuple)):
            return type(x)(of(y) for y in x)
        return x.dtype if isinstance(x, torch.Tensor) else x

    return [of(a) for a in args], {k: of(v) for k, v in kwargs.items()}


def test_decorators_without_autocast_call_fn_unchanged():
    seen = []

    def fn(*args, **kwargs):
        seen.append((args, kwargs))
        return "result"

    h, f, i = torch.randn(2).half(), torch.randn(2), torch.arange(2)
    for deco in (casts.half_function, casts.float_function, casts.promote_function):
        assert deco(fn)(h, [f, h], i, k=f) == "result"
        args, kwargs = seen.pop()
        assert args[0] is h and args[1][0] is f and args[1][1] is h and args[2] is i and kwargs["k"] is f


def test_decorators_keep_name_and_doc():
    def my_fn(x):
        """Doc."""
        return x

    for deco in (casts.half_function, casts.float_function, casts.promote_function):
        wrapped = deco(my_fn)
        assert wrapped.__name__ == "my_fn" and wrapped.__doc__ == "Doc." and wrapped.__wrapped__ is my_fn


def test_half_function_under_o1(o1):
    f, d, i = torch.randn(2), torch.randn(2).double(), torch.arange(2)
    args, kwargs = casts.half_function(_dtypes)(f, d, i, [f, d], [f, 3], "s", k=f)
    assert args == [
        torch.float16,
        torch.float16,
        torch.int64,
        [torch.float16, torch.float16],
        [torch.float32, 3],
        "s",
    ]  # a list with a non-tensor item is not a unit
    assert kwargs == {"k": torch.float16}


def test_half_function_runs_fn_under_autocast(o1):
    @casts.half_function
    def fn(x, w):
        assert x.dtype == w.dtype == torch.float16
        return F.mse_loss(x @ w, torch.zeros(2, 2))  # still cast by autocast inside

    assert fn(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


def test_float_function_under_o1(o1):
    h, i = torch.randn(2).half(), torch.arange(2)
    Pair = collections.namedtuple("Pair", "a b")
    args, kwargs = casts.float_function(_dtypes)(h, Pair(h, h), (h, h), i, k=h)
    assert args == [torch.float32, Pair(torch.float32, torch.float32), (torch.float32, torch.float32), torch.int64]
    assert kwargs == {"k": torch.float32}


def test_promote_function_under_o1(o1):
    h, f, d = torch.randn(2).half(), torch.randn(2), torch.randn(2).double()
    promoted = casts.promote_function(_dtypes)
    assert promoted(h, f) == ([torch.float32, torch.float32], {})
    assert promoted(h, [h, f]) == ([torch.float32, [torch.float32, torch.float32]], {})
    assert promoted(h, h) == ([torch.float16, torch.float16], {})
    assert promoted(h, y=f) == ([torch.float32], {"y": torch.float32})
    assert promoted(f, d) == ([torch.float64, torch.float64], {})  # apex raised here
    assert promoted(h, f.bfloat16()) == ([torch.float32, torch.float32], {})  # and here
    assert promoted(1, "a") == ([1, "a"], {})


def test_decorators_inside_disable_casts_call_fn_unchanged(o1):
    h, f = torch.randn(2).half(), torch.randn(2)
    with casts.disable_casts():
        assert casts.half_function(_dtypes)(f) == ([torch.float32], {})
        assert casts.float_function(_dtypes)(h) == ([torch.float16], {})
        assert casts.promote_function(_dtypes)(h, f) == ([torch.float16, torch.float32], {})


def test_half_function_follows_a_user_bf16_autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert casts.half_function(_dtypes)(torch.randn(2)) == ([torch.bfloat16], {})


# --------------------------------------------------------------------------- registrations


def _module():
    mod = types.ModuleType("user_ops")
    mod.op = _dtypes
    mod.other = _dtypes
    mod.third = _dtypes
    return mod


@pytest.mark.parametrize("register", ["register_half_function", "register_float_function", "register_promote_function"])
def test_register_unknown_name(registry, register):
    mod = _module()
    with pytest.raises(ValueError, match=r"^No function named missing in module <module 'user_ops'>\.$"):
        getattr(registry, register)(mod, "missing")
    assert registry._pending == []


def test_registrations_apply_at_initialize(registry, o1):
    mod = _module()
    registry.register_half_function(mod, "op")
    registry.register_float_function(mod, "other")
    registry.register_promote_function(mod, "third")
    assert mod.op is _dtypes  # nothing changes before initialize
    registry.apply_registrations()
    assert registry._pending == []
    h, f = torch.randn(2).half(), torch.randn(2)
    assert mod.op(f) == ([torch.float16], {})
    assert mod.other(h) == ([torch.float32], {})
    assert mod.third(h, f) == ([torch.float32, torch.float32], {})
    registry.apply_registrations()  # queue was cleared: nothing wrapped twice
    assert mod.op.__wrapped__ is _dtypes
    with casts.disable_casts():
        assert mod.op(f) == ([torch.float32], {})


def test_register_after_initialize_warns_and_waits(registry, caplog):
    registry.apply_registrations()
    mod = _module()
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        registry.register_float_function(mod, "op")
    [record] = [r for r in caplog.records if r.name == "fp16kit"]
    assert record.levelno == logging.WARNING
    assert "register_float_function" in record.getMessage()
    assert "before calling amp.initialize" in record.getMessage()
    assert mod.op is _dtypes
    registry.apply_registrations()  # the next O1 initialize applies it
    assert mod.op.__wrapped__ is _dtypes


def test_register_before_initialize_does_not_warn(registry, caplog):
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        registry.register_half_function(_module(), "op")
    assert not [r for r in caplog.records if r.name == "fp16kit"]


def test_a_ctrl_c_in_a_listed_op_never_leaves_autocast_off(o1):
    # O1 runs an op its lists cast in the cast dtype with autocast off; the switch back is torch's
    # C guard: a Ctrl-C at any line of the call (a set_autocast_enabled(False) before a try, or
    # in a finally, left O1's autocast off for the rest of the run)
    from torch.overrides import _get_current_function_mode_stack

    from _helpers.interrupt import sigint_at

    lists = casts._o1_lists()
    x = torch.randn(4, 4, dtype=torch.float16)
    n = 1
    while True:
        outcome = sigint_at(n, lambda: torch.softmax(x, -1))
        assert torch.is_autocast_enabled("cpu"), f"autocast left off by a Ctrl-C at line {n}"
        if not outcome.fired:
            assert outcome.result.dtype == torch.float32  # apex's list: softmax in fp32
            return
        if all(m is not lists for m in _get_current_function_mode_stack()):
            lists.__enter__()  # torch's own _pop_mode_temporarily, interrupted (not fp16kit's code)
        n += 1
