"""Every apex-era checkpoint layout ``fp16kit.legacy.load_checkpoint`` reads (docs/apex-others.md
§6, §1.5, §2.2-2.3; docs/apex-fp16-optimizer.md; docs/apex-amp.md): Megatron-LM v1 files (``args`` Namespace, numpy and torch
RNG states, rng tracker states, ``model_parallel`` attributes, Megatron and fork scalers), apex
era-2 scalers holding a CUDA int tensor, the fused-era FP16_Optimizer state in both master
layouts, amp state -- each written as that era wrote it, with every storage recorded as saved on
``cuda:0`` (``save_on``), in torch's zip and legacy formats, and loaded on this CPU-only machine.

The expected values are the objects written, compared field by field. numpy is not installed:
its pickles come from ``fake_numpy`` (conftest.py), checked here byte for byte against a pickle
numpy 2.4 wrote.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pickle
import random

import pytest
import torch

from fp16kit.legacy import load_checkpoint
from fp16kit.legacy.checkpoints.load import read_checkpoint

HAVE_NUMPY = importlib.util.find_spec("numpy") is not None  # before any stand-in numpy is installed
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU-only default")
FORMATS = pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])

# ----------------------------------------------------------------------------- Megatron-LM v1


def _megatron_args() -> argparse.Namespace:
    """A few of Megatron's args, as its arguments.py set them (2020)."""
    return argparse.Namespace(
        num_layers=24,
        hidden_size=1024,
        num_attention_heads=16,
        fp16=True,
        params_dtype=torch.float16,
        loss_scale=None,
        loss_scale_window=1000.0,
        min_scale=1.0,
        hysteresis=2,
        data_path=["my-gpt2_text_document"],
        tokenizer_type="GPT2BPETokenizer",
        lr=1.5e-4,
        rank=0,
    )


def _megatron_checkpoint(megatron, fake_numpy, key: list[int]) -> dict:
    """Megatron's save_checkpoint (2020-09, checkpoint_version 3.0): FP16_Module's state dict
    (no ``module.`` prefix), FP16_Optimizer's six keys around FusedAdam's state (a per-group
    ``step``), masters carrying ``model_parallel``, and the RNG states."""
    torch.manual_seed(0)
    weight = torch.randn(4, 3).half()
    bias = torch.randn(4).half()
    masters = [weight.float(), bias.float()]
    masters[0].model_parallel = True
    masters[1].model_parallel = False
    return {
        "args": _megatron_args(),
        "checkpoint_version": 3.0,
        "iteration": 1000,
        "model": {"language_model": {"transformer": {"layers.0.dense.weight": weight, "layers.0.dense.bias": bias}}},
        "optimizer": {
            "loss_scaler": megatron(cur_scale=2.0**31, cur_iter=1000, last_overflow_iter=2, cur_hysteresis=1),
            "dynamic_loss_scale": True,
            "overflow": False,
            "first_closure_call_this_step": True,
            "optimizer_state_dict": {
                "state": {
                    0: {"exp_avg": torch.randn(4, 3), "exp_avg_sq": torch.rand(4, 3)},
                    1: {"exp_avg": torch.randn(4), "exp_avg_sq": torch.rand(4)},
                },
                "param_groups": [
                    {
                        "lr": 1.5e-4,
                        "bias_correction": True,
                        "betas": (0.9, 0.999),
                        "eps": 1e-8,
                        "weight_decay": 0.01,
                        "step": 997,
                        "params": [0, 1],
                    }
                ],
            },
            "fp32_from_fp16": [masters],
        },
        "lr_scheduler": {
            "start_lr": 1.5e-4,
            "warmup_iter": 10,
            "num_iters": 1000,
            "decay_style": "cosine",
            "end_iter": 320000,
            "min_lr": 1e-5,
        },
        "random_rng_state": random.Random(1).getstate(),
        "np_rng_state": fake_numpy.rng_state(key, pos=17, has_gauss=1, cached=-0.5),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.arange(16, dtype=torch.uint8),
        "rng_tracker_states": {"model-parallel-rng": torch.arange(8, dtype=torch.uint8)},
    }


@needs_no_cuda
@FORMATS
def test_a_megatron_v1_checkpoint_saved_on_cuda_loads_on_cpu(tmp_path, megatron, fake_numpy, save_on, legacy):
    key = [random.Random(2).getrandbits(32) for _ in range(624)]
    saved = _megatron_checkpoint(megatron, fake_numpy, key)
    path = save_on(saved, tmp_path / "mp_rank_00_model_states.pt", legacy=legacy)
    with pytest.raises(RuntimeError, match="CUDA"):  # control: the storages really say cuda:0
        torch.load(path, weights_only=False)

    out = load_checkpoint(path)

    assert isinstance(out["args"], argparse.Namespace) and vars(out["args"]) == vars(_megatron_args())
    assert out["args"].params_dtype is torch.float16  # Megatron reads args.foo
    assert (out["checkpoint_version"], out["iteration"]) == (3.0, 1000)
    scaler = out["optimizer"]["loss_scaler"]
    assert scaler == {
        "__apex_class__": "megatron.fp16.loss_scaler.DynamicLossScaler",
        "cur_scale": 2.0**31,
        "cur_iter": 1000,
        "last_overflow_iter": 2,
        "scale_factor": 2.0,
        "scale_window": 1000,
        "min_scale": 1,
        "delayed_shift": 2,
        "cur_hysteresis": 1,
        "consecutive_hysteresis": False,
    }
    assert type(scaler["min_scale"]) is int and type(scaler["cur_scale"]) is float  # as pickled
    np_state = out["np_rng_state"]
    assert type(np_state) is tuple and np_state[0] == "MT19937" and np_state[2:] == (17, 1, -0.5)
    assert np_state[1].dtype == torch.uint32 and np_state[1].shape == (624,)
    assert np_state[1].tolist() == key
    assert out["random_rng_state"] == random.Random(1).getstate()
    assert torch.equal(out["torch_rng_state"], saved["torch_rng_state"])
    assert torch.equal(out["rng_tracker_states"]["model-parallel-rng"], torch.arange(8, dtype=torch.uint8))
    masters = out["optimizer"]["fp32_from_fp16"][0]
    assert [m.model_parallel for m in masters] == [True, False]  # tensor attributes survive
    for a, b in zip(masters, saved["optimizer"]["fp32_from_fp16"][0]):
        assert torch.equal(a, b)
    group = out["optimizer"]["optimizer_state_dict"]["param_groups"][0]
    assert group["step"] == 997 and group["betas"] == (0.9, 0.999)
    layers = out["model"]["language_model"]["transformer"]
    assert layers["layers.0.dense.weight"].dtype == torch.float16
    assert torch.equal(
        layers["layers.0.dense.weight"], saved["model"]["language_model"]["transformer"]["layers.0.dense.weight"]
    )
    tensors = _tensors(out)
    assert len(tensors) == 12 and all(t.device.type == "cpu" for t in tensors)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


@FORMATS
def test_map_location_is_torchs(tmp_path, megatron, save_on, legacy):
    saved = {"w": torch.ones(2), "scaler": megatron()}
    path = save_on(saved, tmp_path / "x.pt", legacy=legacy)
    for map_location in ("cpu", torch.device("cpu"), {"cuda:0": "cpu"}, lambda storage, loc: storage):
        assert load_checkpoint(path, map_location=map_location)["w"].device.type == "cpu"
    assert load_checkpoint(path, map_location="meta")["w"].device.type == "meta"
    if not torch.cuda.is_available():  # torch's own error for a device that is not there
        with pytest.raises(RuntimeError, match="CUDA"):
            load_checkpoint(path, map_location="cuda:0")


@pytest.mark.parametrize("module", ["megatron.fp16.loss_scaler", "fp16.loss_scaler"])
def test_megatron_and_fork_scalers_come_back_with_exactly_their_attributes(tmp_path, stand_ins, megatron, module, save):
    """``fp16.loss_scaler`` is Megatron's 2019 path (GLM, sentiment-discovery, ...). An object
    pickled by older code lacks ``min_scale``/``delayed_shift``/...: those stay absent (the
    Megatron loader applies docs/apex-others.md §2.3's defaults)."""
    static = stand_ins.add(f"{module}.LossScaler")()
    static.cur_scale = 128
    old = megatron(module, min_scale=None, delayed_shift=None, cur_hysteresis=None, consecutive_hysteresis=None)
    path = save({"static": static, "old": old}, tmp_path / "s.pt")
    stand_ins.remove()  # as on a machine without Megatron

    out = load_checkpoint(path)
    assert out["static"] == {"__apex_class__": f"{module}.LossScaler", "cur_scale": 128}
    assert out["old"] == {
        "__apex_class__": f"{module}.DynamicLossScaler",
        "cur_scale": 2**32,
        "cur_iter": 0,
        "last_overflow_iter": -1,
        "scale_factor": 2.0,
        "scale_window": 1000,
    }


@needs_no_cuda
@FORMATS
def test_an_era2_scaler_holding_a_cuda_int_tensor_loads_on_cpu(tmp_path, fake_apex, save_on, legacy):
    path = save_on(
        {"optimizer": {"loss_scaler": fake_apex.era2(1024.0, unskipped=7)}}, tmp_path / "e2.pt", legacy=legacy
    )
    fake_apex.remove()
    scaler = load_checkpoint(path)["optimizer"]["loss_scaler"]
    assert scaler["_overflow_buf"].device.type == "cpu" and scaler["_overflow_buf"].dtype == torch.int32
    assert scaler["_overflow_buf"].tolist() == [0]
    assert (scaler["_loss_scale"], scaler["_unskipped"], scaler["_scale_seq_len"]) == (1024.0, 7, 2000)


# ------------------------------------------------------------ fused-era FP16_Optimizer and amp


def _fused_era_state(layout: str) -> dict:
    """docs/apex-others.md §1.5: apex.optimizers.FP16_Optimizer.state_dict() around the legacy FusedAdam (per-param
    int ``step``; groups carry ``max_grad_norm``/``bias_correction``)."""
    sizes = [(3, 5), (4,)]
    masters = [torch.randn(*s) for s in sizes]
    inner_params = [0] if layout == "flat" else [0, 1]
    return {
        "dynamic_loss_scale": True,
        "cur_scale": 2**16,
        "cur_iter": 12,
        "last_overflow_iter": 3,
        "scale_factor": 2,
        "scale_window": 1000,
        "optimizer_state_dict": {
            "state": {
                i: {
                    "step": 9,
                    "exp_avg": torch.randn(19 if layout == "flat" else sizes[i][0]),
                    "exp_avg_sq": torch.rand(19 if layout == "flat" else sizes[i][0]),
                }
                for i in inner_params
            },
            "param_groups": [
                {
                    "lr": 5e-5,
                    "bias_correction": False,
                    "betas": (0.9, 0.999),
                    "eps": 1e-6,
                    "weight_decay": 0.01,
                    "max_grad_norm": 1.0,
                    "params": inner_params,
                }
            ],
        },
        **(
            {"fp32_groups_flat": [torch.cat([m.flatten() for m in masters])]}
            if layout == "flat"
            else {"fp32_groups": [masters]}
        ),
    }


@needs_no_cuda
@pytest.mark.parametrize("layout", ["flat", "per-param"])
def test_a_fused_era_fp16_optimizer_state_loads_as_saved(tmp_path, save_on, layout):
    saved = {"optimizer": _fused_era_state(layout)}
    out = load_checkpoint(save_on(saved, tmp_path / "f.pt"))["optimizer"]
    assert {k: v for k, v in out.items() if not isinstance(v, (dict, list))} == {
        "dynamic_loss_scale": True,
        "cur_scale": 2**16,
        "cur_iter": 12,
        "last_overflow_iter": 3,
        "scale_factor": 2,
        "scale_window": 1000,
    }
    masters = "fp32_groups_flat" if layout == "flat" else "fp32_groups"
    assert set(out) == set(saved["optimizer"])
    if layout == "flat":
        assert torch.equal(out[masters][0], saved["optimizer"][masters][0])
    else:
        assert all(torch.equal(a, b) for a, b in zip(out[masters][0], saved["optimizer"][masters][0]))
    assert [s["step"] for s in out["optimizer_state_dict"]["state"].values()] == [9] * (1 if layout == "flat" else 2)


def test_amp_state_is_plain_already(tmp_path, save):
    """amp.state_dict(): one {'loss_scale', 'unskipped'} dict per loss (docs/apex-amp.md §9)."""
    saved = {
        "model": {"w": torch.ones(2)},
        "amp": {
            "loss_scaler0": {"loss_scale": 32768.0, "unskipped": 17},
            "loss_scaler1": {"loss_scale": 1.0, "unskipped": 0},
        },
    }
    out = load_checkpoint(save(saved, tmp_path / "amp.pt"))
    assert out["amp"] == saved["amp"]
    assert torch.load(tmp_path / "amp.pt", weights_only=True)["amp"] == saved["amp"]


# ----------------------------------------------------------------------------------- numpy

# What numpy 2.4.6 pickled (protocol 2) for {'a': np.array([1, 2, 3], dtype='<u4'), 's': np.float32(1.5)}.
NUMPY_2_PICKLE = (
    b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01cnumpy._core.multiarray\n_reconstruct\nq\x02cnumpy\nndarray\nq\x03K"
    b"\x00\x85q\x04c_codecs\nencode\nq\x05X\x01\x00\x00\x00bq\x06X\x06\x00\x00\x00latin1q\x07\x86q\x08Rq\t\x87q\nRq"
    b"\x0b(K\x01K\x03\x85q\x0ccnumpy\ndtype\nq\rX\x02\x00\x00\x00u4q\x0e\x89\x88\x87q\x0fRq\x10(K\x03X\x01\x00\x00\x00"
    b"<q\x11NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tq\x12b\x89h\x05X\x0c\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00"
    b"\x00\x03\x00\x00\x00q\x13h\x07\x86q\x14Rq\x15tq\x16bX\x01\x00\x00\x00sq\x17cnumpy._core.multiarray\nscalar\n"
    b"q\x18h\rX\x02\x00\x00\x00f4q\x19\x89\x88\x87q\x1aRq\x1b(K\x03h\x11NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tq"
    b"\x1cbh\x05X\x05\x00\x00\x00\x00\x00\xc3\x80?q\x1dh\x07\x86q\x1eRq\x1f\x86q Rq!u."
)


def test_the_fake_numpy_pickles_what_numpy_pickles(fake_numpy_2):
    fake = fake_numpy_2
    assert pickle.dumps({"a": fake.array([1, 2, 3], "<u4"), "s": fake.scalar(1.5, "<f4")}, protocol=2) == NUMPY_2_PICKLE


def test_numpy_2s_own_pickle_loads(tmp_path, save):
    path = save({"x": torch.ones(1)}, tmp_path / "n.pt")
    _replace_data_pkl(path, NUMPY_2_PICKLE)
    out = load_checkpoint(path)
    if _numpy() is None:
        assert out["a"].dtype == torch.uint32 and out["a"].tolist() == [1, 2, 3]
        assert type(out["s"]) is float and out["s"] == 1.5
    else:
        assert out["a"].dtype == _numpy().uint32 and out["a"].tolist() == [1, 2, 3]
        assert out["s"].dtype == _numpy().float32 and out["s"] == 1.5


def _numpy():
    return importlib.import_module("numpy") if HAVE_NUMPY else None


def _replace_data_pkl(path, data_pkl: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(path) as zin:
        records = [(info, zin.read(info.filename)) for info in zin.infolist()]
    with zipfile.ZipFile(path, "w") as zout:
        for info, data in records:
            zout.writestr(info, data_pkl if info.filename.endswith("/data.pkl") else data)


NUMBERS = [
    # (typestr, values, what they read back as without numpy)
    ("|b1", [True, False, True], torch.bool),
    ("|i1", [-128, 0, 127], torch.int8),
    ("|u1", [0, 200, 255], torch.uint8),
    ("<i2", [-3, 0, 300], torch.int16),
    (">i2", [-3, 0, 300], torch.int16),
    ("<u2", [0, 65535, 7], torch.uint16),
    ("<i4", [-(2**31), 5, 2**31 - 1], torch.int32),
    ("<u4", [0, 2**32 - 1, 12345], torch.uint32),
    (">u4", [0, 2**32 - 1, 12345], torch.uint32),
    ("<i8", [-(2**63), 1, 2**63 - 1], torch.int64),
    ("<u8", [0, 2**64 - 1, 3], torch.uint64),
    ("<f2", [0.5, -2.0, 65504.0], torch.float16),
    ("<f4", [1.5, -0.25, 2.0**100], torch.float32),
    (">f8", [1e-300, -2.5, 1e300], torch.float64),
    ("<c8", [1 + 2j, -0.5j, 3], torch.complex64),
    (">c16", [1 + 2j, -0.5j, 3], torch.complex128),
]


@pytest.mark.parametrize("typestr,values,dtype", NUMBERS, ids=[n[0] for n in NUMBERS])
def test_numpy_arrays_and_scalars_read_back_exactly(tmp_path, fake_numpy, save, typestr, values, dtype):
    saved = {
        "array": fake_numpy.array(values, typestr),
        "scalar": fake_numpy.scalar(values[1], typestr),
        "dtype": fake_numpy.dtype(typestr),
    }
    path = save(saved, tmp_path / "np.pt")
    out = read_checkpoint(path, plain_numpy=True)[0]  # load_checkpoint's form without numpy
    assert out["array"].dtype == dtype and out["array"].shape == (3,)
    assert out["array"].tolist() == values
    assert out["scalar"] == values[1] and type(out["scalar"]) is type(dtype_value(dtype))
    assert out["dtype"] == ("|" if typestr[1] == "b" or typestr.endswith("1") else typestr[0]) + typestr[1:]


def dtype_value(dtype):
    return True if dtype == torch.bool else 1j if dtype.is_complex else 1.0 if dtype.is_floating_point else 1


def test_numpy_array_shapes_orders_and_empty_arrays(tmp_path, fake_numpy, save):
    values = list(range(6))
    saved = {
        "c": fake_numpy.array(values, "<i8", shape=(2, 3)),
        # Fortran order: memory holds the columns [[0, 1, 2], [3, 4, 5]] -> 0 3 1 4 2 5
        "f": fake_numpy.array([0, 3, 1, 4, 2, 5], "<i8", shape=(2, 3), fortran=True),
        "empty": fake_numpy.array([], "<f8", shape=(0, 3)),  # b"" pickles as builtins.bytes()
        "zero_d": fake_numpy.array([7], "<i4", shape=()),
    }
    out = read_checkpoint(save(saved, tmp_path / "np.pt"), plain_numpy=True)[0]
    assert out["c"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["f"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["empty"].shape == (0, 3) and out["empty"].dtype == torch.float64
    assert out["zero_d"].shape == () and out["zero_d"].item() == 7


def test_numpy_arrays_are_numpys_when_numpy_is_installed(tmp_path, fake_numpy, stand_ins, save):
    path = save({"a": fake_numpy.array([0, 3, 1, 4, 2, 5], ">i2", (2, 3), fortran=True)}, tmp_path / "n.pt")
    stand_ins.remove()  # the real numpy back, if there is one
    if not HAVE_NUMPY:
        assert load_checkpoint(path)["a"].tolist() == [[0, 1, 2], [3, 4, 5]]  # a tensor without numpy
        pytest.skip("numpy is not installed")
    np = _numpy()
    out = load_checkpoint(path)
    assert isinstance(out["a"], np.ndarray) and out["a"].dtype == np.dtype(">i2")
    assert out["a"].tolist() == [[0, 1, 2], [3, 4, 5]]


# ---------------------------------------------------------------- crafted numpy / Namespace


def test_numpy_object_arrays_and_odd_dtypes_are_refused(tmp_path, fake_numpy, save):
    for typestr in ("|O8", "<M8", "|V4", "<f16"):
        path = save({"a": fake_numpy.ndarray((1,), typestr, b"\0" * 8)}, tmp_path / "o.pt")
        with pytest.raises(pickle.UnpicklingError, match="numpy.dtype in this file"):
            load_checkpoint(path)


def test_numpy_raw_data_of_the_wrong_size_is_refused(tmp_path, fake_numpy, save):
    """A shape promising 2**40 items with 8 bytes of data: refused before anything is allocated."""
    path = save({"a": fake_numpy.ndarray((2**40,), "<u4", b"\0" * 8)}, tmp_path / "big.pt")
    with pytest.raises(pickle.UnpicklingError, match="raw data of another size"):
        load_checkpoint(path)


def test_numpys_reconstruct_only_builds_arrays(tmp_path, fake_numpy, stand_ins, save):
    """``_reconstruct(cls, ...)`` with any class but ndarray (here a dtype) is refused."""

    class Evil:
        def __reduce__(self):
            return (fake_numpy._reconstruct, (fake_numpy.dtype, (0,), b"b"))

    with pytest.raises(pickle.UnpicklingError, match="only read for numpy.ndarray"):
        load_checkpoint(save({"e": Evil()}, tmp_path / "e.pt"))


def test_bytes_is_only_read_empty(tmp_path, stand_ins, save):
    """``builtins.bytes`` is allowed for numpy's empty arrays (``b""``); ``bytes(2**40)`` would
    allocate a TB: refused."""

    class Big:
        def __reduce__(self):
            return (bytes, (2**40,))

    with pytest.raises(pickle.UnpicklingError, match=r"only read without arguments"):
        load_checkpoint(save({"b": Big()}, tmp_path / "b.pt"))


def test_a_namespace_attribute_named_like_a_dunder_stays_data(tmp_path, save):
    ns = argparse.Namespace(lr=0.1)
    ns.__dict__["__class__"] = "not a class"
    out = load_checkpoint(save({"args": ns}, tmp_path / "n.pt"))["args"]
    assert type(out) is argparse.Namespace and out.lr == 0.1 and vars(out)["__class__"] == "not a class"


class _Key:
    """Pickles as a record where a checkpoint never holds one."""


@pytest.mark.parametrize("where", ["dict key", "set member", "tensor attribute"])
def test_an_allowed_object_hidden_where_checkpoints_never_hold_one_is_refused(tmp_path, megatron, save, where):
    scaler = megatron()
    scaler.__hash__ = None
    t = torch.ones(2)
    cls = type(scaler)
    cls.__hash__ = object.__hash__
    obj = {
        "dict key": lambda: {scaler: 1},
        "set member": lambda: {"s": {scaler}},
        "tensor attribute": lambda: (setattr(t, "scaler", scaler), {"t": t})[1],
    }[where]()
    with pytest.raises(pickle.UnpicklingError, match="where a checkpoint never holds one"):
        load_checkpoint(save(obj, tmp_path / "h.pt"))


# ------------------------------------------------------------------------------- misuse


def test_a_megatron_scaler_given_to_fp16_utils_fp16_optimizer_names_the_right_loader(tmp_path, megatron, save):
    from fp16kit.legacy import FP16_Optimizer

    model = torch.nn.Linear(2, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    sd = opt.state_dict()
    sd["loss_scaler"] = megatron()
    loaded = load_checkpoint(save({"optimizer": sd}, tmp_path / "m.pt"))
    with pytest.raises(ValueError, match=r"Megatron-LM's scaler .* fp16kit\.legacy\.megatron\.FP16_Optimizer"):
        opt.load_state_dict(loaded["optimizer"])
    assert opt.loss_scale == 2.0**16  # unchanged


def test_a_file_object_is_left_where_torch_load_leaves_it(tmp_path, megatron, save):
    import io

    data = save({"s": megatron(), "w": torch.ones(3)}, tmp_path / "x.pt").read_bytes()
    f = io.BytesIO(b"junk" + data)
    f.seek(4)
    load_checkpoint(f)
    g = io.BytesIO(b"junk" + data)
    g.seek(4)
    try:
        torch.load(g, weights_only=False)
    except Exception:
        pass
    assert f.tell() == g.tell()


def test_loads_in_several_threads_at_once(tmp_path, megatron, save):
    """torch's allow-list is process-wide; load_checkpoint adds and removes its stand-ins around
    each load, so concurrent loads take turns instead of removing each other's."""
    import threading

    path = save({"s": megatron(), "args": argparse.Namespace(a=1)}, tmp_path / "t.pt")
    errors: list = []

    def work():
        try:
            for _ in range(20):
                assert load_checkpoint(path)["args"].a == 1
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@FORMATS
def test_a_file_really_saved_on_cuda_loads_where_asked(tmp_path, fake_apex, save, legacy):
    """What the save_on tests stand for, on a GPU: tensors and an era-2 scaler's
    ``torch.cuda.IntTensor`` saved from cuda:0 stay there by default (as torch.load) and land on
    the CPU with map_location="cpu"; attributes survive either way."""
    master = torch.ones(3, device="cuda")
    master.model_parallel = True
    scaler = fake_apex.era2(512.0)
    scaler._overflow_buf = torch.cuda.IntTensor([0])
    path = tmp_path / "gpu.pt"
    torch.save({"m": master, "s": scaler}, path, _use_new_zipfile_serialization=not legacy)
    fake_apex.remove()
    on_gpu = load_checkpoint(path)
    assert on_gpu["m"].device.type == "cuda" and on_gpu["s"]["_overflow_buf"].device.type == "cuda"
    on_cpu = load_checkpoint(path, map_location="cpu")
    assert on_cpu["m"].device.type == "cpu" and on_cpu["m"].model_parallel is True
    assert on_cpu["s"]["_overflow_buf"].device.type == "cpu" and on_cpu["s"]["_loss_scale"] == 512.0
