"""``amp.lists`` (fp16kit/legacy/amp/lists/): apex's O1 lists as scripts edit them before
``amp.initialize``. The pattern is NVIDIA DeepLearningExamples' Tacotron2 and WaveGlow
``train.py`` (and their READMEs)::

    from apex import amp
    amp.lists.functional_overrides.FP32_FUNCS.remove('softmax')
    amp.lists.functional_overrides.FP16_FUNCS.append('softmax')

run here on Tacotron2's location-sensitive attention: the softmax over the alignment energies runs
in fp16, bit for bit a hand-cast fp16 softmax. Then an op added to a list, ops removed, the banned
list edited, an edit after initialize (no effect until the next one), a registration over an edit,
a bad entry, and the import forms under the alias, under ``fp16kit run`` and after ``fp16kit
migrate``. The lists are process-global: every test puts them back as shipped.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp16kit
from fp16kit.legacy import amp
from fp16kit.legacy.apex_alias import install_apex_alias, uninstall_apex_alias

casts = importlib.import_module("fp16kit.legacy.amp.casts")
o1_lists = importlib.import_module("fp16kit.legacy.amp.o1_lists")
_amp_state = importlib.import_module("fp16kit.legacy.amp._amp_state")._amp_state

ROOT = pathlib.Path(fp16kit.__file__).resolve().parent.parent
LISTS = (amp.lists.functional_overrides, amp.lists.torch_overrides, amp.lists.tensor_overrides)
NAMES = ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS", "BANNED_FUNCS")


@pytest.fixture(autouse=True)
def _shipped_lists():
    """The lists as shipped before and after every test (the same list objects, their contents
    restored), O1 off, the shipped lists' rules installed again."""
    saved = [(m, n, getattr(m, n), list(getattr(m, n))) for m in LISTS for n in NAMES if hasattr(m, n)]
    properties = getattr(_amp_state, "opt_properties", None)
    yield
    casts._disable_o1_for_tests()
    for module, name, obj, contents in saved:
        obj[:] = contents
        setattr(module, name, obj)
    o1_lists.install(casts.read_lists())
    _amp_state.opt_properties = properties


def _tacotron2_edit():
    amp.lists.functional_overrides.FP32_FUNCS.remove("softmax")
    amp.lists.functional_overrides.FP16_FUNCS.append("softmax")


# ------------------------------------------------- Tacotron2's attention (tacotron2/model.py)
class LinearNorm(nn.Module):
    def __init__(self, in_dim, out_dim, bias=True, w_init_gain="linear"):
        super().__init__()
        self.linear_layer = nn.Linear(in_dim, out_dim, bias=bias)
        nn.init.xavier_uniform_(self.linear_layer.weight, gain=nn.init.calculate_gain(w_init_gain))

    def forward(self, x):
        return self.linear_layer(x)


class LocationLayer(nn.Module):
    def __init__(self, n_filters, kernel_size, attention_dim):
        super().__init__()
        self.location_conv = nn.Conv1d(2, n_filters, kernel_size, padding=(kernel_size - 1) // 2, bias=False)
        self.location_dense = LinearNorm(n_filters, attention_dim, bias=False, w_init_gain="tanh")

    def forward(self, attention_weights_cat):
        processed = self.location_conv(attention_weights_cat).transpose(1, 2)
        return self.location_dense(processed)


class Attention(nn.Module):
    def __init__(self, attention_rnn_dim=16, embedding_dim=12, attention_dim=8, n_filters=4, kernel_size=3):
        super().__init__()
        self.query_layer = LinearNorm(attention_rnn_dim, attention_dim, bias=False, w_init_gain="tanh")
        self.memory_layer = LinearNorm(embedding_dim, attention_dim, bias=False, w_init_gain="tanh")
        self.v = LinearNorm(attention_dim, 1, bias=False)
        self.location_layer = LocationLayer(n_filters, kernel_size, attention_dim)
        self.score_mask_value = -float("inf")

    def get_alignment_energies(self, query, processed_memory, attention_weights_cat):
        processed_query = self.query_layer(query.unsqueeze(1))
        processed_attention_weights = self.location_layer(attention_weights_cat)
        energies = self.v(torch.tanh(processed_query + processed_attention_weights + processed_memory))
        return energies.squeeze(-1)

    def forward(self, attention_hidden_state, memory, processed_memory, attention_weights_cat, mask):
        alignment = self.get_alignment_energies(attention_hidden_state, processed_memory, attention_weights_cat)
        if mask is not None:
            alignment.data.masked_fill_(mask, self.score_mask_value)
        attention_weights = F.softmax(alignment, dim=1)
        attention_context = torch.bmm(attention_weights.unsqueeze(1), memory)
        return attention_context.squeeze(1), attention_weights


def _attention_o1(seed=0, device="cpu"):
    torch.manual_seed(seed)
    model = Attention().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level="O1", verbosity=0)


def _decoder_step(model, batch=3, steps=7, device="cpu"):
    """One decoder step's inputs as Tacotron2's Decoder builds them (processed_memory once per
    utterance, the previous and cumulative attention weights, the padding mask)."""
    g = torch.Generator().manual_seed(11)
    memory = torch.randn(batch, steps, 12, generator=g).to(device)
    lengths = torch.tensor([steps, steps - 2, steps - 3], device=device)
    mask = torch.arange(steps, device=device)[None, :] >= lengths[:, None]
    previous = torch.rand(batch, steps, generator=g).to(device).softmax(1)
    weights_cat = torch.stack([previous, previous.cumsum(1)], dim=1)
    query = torch.randn(batch, 16, generator=g).to(device)
    return query, memory, model.memory_layer(memory), weights_cat, mask


def _weights_and_by_hand(model, dtype, device="cpu"):
    """The attention weights of one O1 step, and the softmax of the same masked alignment
    energies cast to ``dtype`` by hand (casts off)."""
    query, memory, processed_memory, weights_cat, mask = _decoder_step(model, device=device)
    context, weights = model(query, memory, processed_memory, weights_cat, mask)
    alignment = model.get_alignment_energies(query, processed_memory, weights_cat)  # fp16: v is a Linear
    alignment.data.masked_fill_(mask, model.score_mask_value)
    with amp.disable_casts():
        by_hand = F.softmax(alignment.to(dtype), dim=1)
    return context, weights, alignment, by_hand


def test_tacotron2_softmax_moved_to_fp16_runs_in_fp16():
    _tacotron2_edit()  # train.py, at import: before amp.initialize
    model, opt = _attention_o1()
    context, weights, alignment, by_hand = _weights_and_by_hand(model, torch.float16)
    assert weights.dtype == torch.float16 and context.dtype == torch.float16
    assert by_hand.dtype == torch.float16 and torch.equal(weights, by_hand)
    assert alignment.softmax(1).dtype == torch.softmax(alignment, 1).dtype == torch.float16  # its aliases follow

    with amp.scale_loss(context.float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    for p in model.parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
    opt.step()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tacotron2_softmax_moved_to_fp16_runs_in_fp16_on_cuda():
    # CUDA autocast alone keeps softmax in fp32: the edited list decides, as apex's patch did
    _tacotron2_edit()
    model, _ = _attention_o1(device="cuda")
    _, weights, _, by_hand = _weights_and_by_hand(model, torch.float16, device="cuda")
    assert weights.dtype == torch.float16 and torch.equal(weights, by_hand)


def test_shipped_lists_keep_softmax_in_fp32():
    model, _ = _attention_o1()
    _, weights, _, by_hand = _weights_and_by_hand(model, torch.float32)
    assert weights.dtype == torch.float32 and torch.equal(weights, by_hand)


def test_an_edit_after_initialize_waits_for_the_next_initialize():
    model, _ = _attention_o1()
    _tacotron2_edit()  # too late for this initialize, as in apex
    inputs = _decoder_step(model)
    assert model(*inputs)[1].dtype == torch.float32
    _attention_o1(seed=1)  # the next O1 initialize reads the lists as they are now (process-wide)
    assert model(*inputs)[1].dtype == torch.float16
    amp.lists.functional_overrides.FP16_FUNCS.remove("softmax")
    amp.lists.functional_overrides.FP32_FUNCS.append("softmax")
    amp.init()  # the 2018 API reads them too
    assert model(*inputs)[1].dtype == torch.float32


# --------------------------------------------------------------------- other edits
def test_a_name_appended_to_fp32_funcs_runs_in_fp32():
    # Transformer-XL's attention scores: torch.einsum, on no apex list (autocast's fp16 on CPU)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 2, 3, 4, generator=g), torch.randn(6, 2, 3, 4, generator=g)
    _attention_o1()
    assert torch.einsum("ibnd,jbnd->ijbn", q, k).dtype == torch.float16
    amp.lists.torch_overrides.FP32_FUNCS.append("einsum")
    _attention_o1()
    scores = torch.einsum("ibnd,jbnd->ijbn", q.half(), k)
    with amp.disable_casts():
        expected = torch.einsum("ibnd,jbnd->ijbn", q.half().float(), k)
    assert scores.dtype == torch.float32 and torch.equal(scores, expected)


def test_a_name_removed_from_fp32_funcs_follows_autocast():
    h = torch.randn(300, 4, generator=torch.Generator().manual_seed(5)).half() * 300
    amp.lists.torch_overrides.FP32_FUNCS.remove("sum")
    _attention_o1()
    with amp.disable_casts():
        plain = torch.sum(h)
    assert torch.sum(h).dtype == torch.float16 and torch.equal(torch.sum(h), plain)
    # tensor_overrides copied 'sum' at import, as apex's did: the method keeps its entry
    assert h.sum().dtype == torch.float32
    amp.lists.tensor_overrides.FP32_FUNCS.remove("sum")
    _attention_o1()
    assert h.sum().dtype == torch.float16


def test_softmax_removed_from_every_list_follows_autocast():
    amp.lists.functional_overrides.FP32_FUNCS.remove("softmax")
    _attention_o1()
    h = torch.randn(3, 4).half()
    with amp.disable_casts():
        plain = F.softmax(h, dim=1)
    assert torch.equal(F.softmax(h, dim=1), plain) and F.softmax(h, dim=1).dtype == torch.float16
    assert h.softmax(1).dtype == torch.float16  # the alias went with it
    assert F.log_softmax(h, dim=1).dtype == torch.float32  # the other names keep theirs


def test_the_in_place_errors_follow_the_fp32_lists():
    h = torch.rand(3).half()
    _attention_o1()
    with pytest.raises(NotImplementedError, match="in-place function exp_"):
        torch.exp_(h.clone())
    amp.lists.torch_overrides.FP32_FUNCS.remove("exp")
    _attention_o1()
    with amp.disable_casts():
        plain = torch.exp_(h.clone())
    assert torch.equal(torch.exp_(h.clone()), plain)  # allowed now
    with pytest.raises(NotImplementedError, match="in-place method exp_"):
        h.clone().exp_()  # tensor_overrides still lists 'exp'


def test_banned_funcs_edits():
    probs = torch.rand(3, 4, generator=torch.Generator().manual_seed(2)).half()
    target = torch.rand(3, 4, generator=torch.Generator().manual_seed(3))
    # a ban of one's own, with its message; fp32 arguments pass, in fp32 (mse_loss's list)
    amp.lists.functional_overrides.BANNED_FUNCS.append(("mse_loss", "no fp16 mse_loss here"))
    _attention_o1()
    with pytest.raises(NotImplementedError) as e:
        F.mse_loss(probs, target)
    assert str(e.value) == "no fp16 mse_loss here"
    assert F.mse_loss(probs.float(), target).dtype == torch.float32
    # BCE un-banned and put on the FP32 list: fp16 probabilities run in fp32
    banned = amp.lists.functional_overrides.BANNED_FUNCS
    banned[:] = [entry for entry in banned if entry[0] != "binary_cross_entropy"]
    amp.lists.functional_overrides.FP32_FUNCS.append("binary_cross_entropy")
    _attention_o1()
    loss = F.binary_cross_entropy(probs, target)
    with amp.disable_casts():
        expected = F.binary_cross_entropy(probs.float(), target)
    assert loss.dtype == torch.float32 and torch.equal(loss, expected)


def test_a_ban_is_checked_before_the_other_lists():
    # apex wrapped the banned functions last, around their list wrapper
    amp.lists.functional_overrides.FP32_FUNCS.append("binary_cross_entropy")
    _attention_o1()
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(torch.rand(3).half(), torch.rand(3))


def test_a_registration_decides_over_the_lists(monkeypatch):
    monkeypatch.setattr(casts, "_pending", [])
    monkeypatch.setattr(o1_lists, "_EXEMPT", set())
    monkeypatch.setattr(F, "softmax", F.softmax)  # put back after the test
    _tacotron2_edit()
    amp.register_float_function(F, "softmax")  # apex applied registrations innermost: they decide
    model, _ = _attention_o1()
    _, weights, _, by_hand = _weights_and_by_hand(model, torch.float32)
    assert weights.dtype == torch.float32 and torch.equal(weights, by_hand)


def test_an_entry_that_is_not_a_name_is_refused_before_anything_changes():
    amp.lists.functional_overrides.FP16_FUNCS.append(F.softmax)  # the function, not its name
    torch.manual_seed(0)
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    properties = getattr(_amp_state, "opt_properties", None)
    with pytest.raises(
        TypeError,
        match=r"amp\.lists\.functional_overrides\.FP16_FUNCS holds <function softmax"
        r".*FP16_FUNCS\.append\('softmax'\).*before amp\.initialize",
    ):
        amp.initialize(model, opt, opt_level="O1", verbosity=0)
    assert getattr(_amp_state, "opt_properties", None) is properties
    assert not hasattr(opt, "_amp_stash")
    assert torch.exp(torch.ones(2).half()).dtype == torch.float16  # O1 not switched on


def test_apexs_layout():
    fo, to, te = LISTS
    assert (fo.MODULE, to.MODULE, te.MODULE) == (F, torch, torch.Tensor)
    assert amp.lists.functional_overrides is importlib.import_module("fp16kit.legacy.amp.lists.functional_overrides")
    assert all(isinstance(getattr(m, n), list) for m in LISTS for n in NAMES if hasattr(m, n))
    assert [name for name, _ in fo.BANNED_FUNCS] == ["binary_cross_entropy"]
    # apex's tensor_overrides: its own names, then torch_overrides' names that Tensor has
    assert te.FP32_FUNCS == [
        "__ipow__",
        "__pow__",
        "__rpow__",
        "cpu",
        *(n for n in to.FP32_FUNCS if hasattr(torch.Tensor, n)),
    ]
    assert "conv1d" in to.FP16_FUNCS and "conv1d" not in te.FP16_FUNCS
    assert to.SEQUENCE_CASTS == ["cat", "stack"] and te.SEQUENCE_CASTS == []


# ------------------------------------------------------------- the import forms scripts use
@pytest.fixture
def alias():
    install_apex_alias()
    yield
    uninstall_apex_alias()


def test_import_forms_under_the_alias(alias):
    import apex.amp.lists.torch_overrides
    from apex import amp as apex_amp
    from apex.amp.lists import functional_overrides
    from apex.amp.lists.tensor_overrides import FP32_FUNCS

    assert apex_amp.lists is amp.lists and functional_overrides is amp.lists.functional_overrides
    assert apex.amp.lists.torch_overrides is amp.lists.torch_overrides
    assert FP32_FUNCS is amp.lists.tensor_overrides.FP32_FUNCS


TACOTRON2_TRAIN = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F
    from apex import amp
    import apex.amp.lists.torch_overrides
    from apex.amp.lists import functional_overrides

    amp.lists.functional_overrides.FP32_FUNCS.remove('softmax')
    amp.lists.functional_overrides.FP16_FUNCS.append('softmax')
    apex.amp.lists.torch_overrides.FP32_FUNCS.append('einsum')

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    alignment = model(torch.randn(3, 4))
    weights = F.softmax(alignment, dim=1)
    with amp.disable_casts():
        by_hand = F.softmax(alignment.half(), dim=1)
    x = torch.randn(2, 3)
    print("softmax", weights.dtype, torch.equal(weights, by_hand), functional_overrides.FP16_FUNCS[-1],
          "einsum", torch.einsum("ij,kj->ik", x, x).dtype)
""")
EXPECTED = "softmax torch.float16 True softmax einsum torch.float32\n"


def _python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_tacotron2_train_under_fp16kit_run_and_migrated(tmp_path, capsys):
    pytest.importorskip("libcst")
    from fp16kit.cli import main as cli_main

    script = tmp_path / "train.py"
    script.write_text(TACOTRON2_TRAIN)
    under_run = _python("-m", "fp16kit", "run", str(script))
    assert under_run.returncode == 0, under_run.stderr
    assert under_run.stdout.endswith(EXPECTED)

    assert cli_main(["migrate", str(script)]) == 0
    assert "left for you" not in capsys.readouterr().out
    code = script.read_text()
    assert "from fp16kit.legacy.amp.lists import functional_overrides" in code
    assert "import fp16kit.legacy.amp.lists.torch_overrides" in code and "apex" not in code
    migrated = _python(str(script))  # no alias: plain python with fp16kit importable
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout == under_run.stdout
