"""Every fenced ```python block in README.md and MIGRATION.md runs as written, on CPU.

How a block runs
  * The markdown is parsed line by line: a fence opens with ``` (up to three spaces of indent)
    and an info string; only ``python``/``py``/``python3`` blocks run (``sh``, plain ``` and
    other languages are documentation). Each block is one parametrized test whose id names
    the file, the fence's line and the section heading, e.g. ``README.md:L35:use``. A failing
    block's traceback points at its line in the markdown file.
  * A block runs with ``exec`` in a fresh namespace holding the names a reader of that file
    supplies (see ``_reader_names``). Blocks are not edited, with one substitution: when CUDA
    is unavailable, every string literal ``"cuda"``/``'cuda'`` becomes ``"cpu"`` (the same code
    on the CPU device; the reader names live on the device the blocks name).
  * Markers, an HTML comment on the line just before the fence (invisible when rendered):
      ``<!-- docs-test: continue -->``       run in the namespace left by the previous python
                                            block of the same file (the test re-runs that
                                            chain from its start, so each test stands alone);
      ``<!-- docs-test: skip (reason) -->``  deliberately not runnable (a signature, a
                                            fragment); the test is reported as skipped.
    Keep them rare; ``test_markers_are_well_formed`` rejects misspelled or misplaced ones.
  * Where a block makes a claim a test can check cheaply (the model trains, stays fp16, ...),
    a check registered with ``@claim(<a line of that block>)`` runs after it;
    ``test_every_claim_matches_one_block`` keeps those keys in step with the docs.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import re
import sys
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fp16kit

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ("README.md", "MIGRATION.md")
RUNNABLE = {"python", "py", "python3"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_FENCE = re.compile(r"^( {0,3})(`{3,})\s*([^`\s]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_MARKER_BODY = re.compile(r"^(continue|skip\s*\((?P<reason>[^)]+)\))$")


# ---------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class Block:
    file: str
    line: int  # 1-based line of the opening fence
    lang: str
    heading: str
    source: str
    marker: str | None  # None, "continue" or "skip"
    reason: str = ""

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-") or "top"
        return f"{self.file}:L{self.line}:{slug}"

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE


def parse(file: str) -> list[Block]:
    """The fenced blocks of ``file`` (all languages), with heading and marker."""
    lines = (ROOT / file).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    heading = ""
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            if lines[i].startswith("#"):
                heading = lines[i].lstrip("#").strip()
            i += 1
            continue
        indent, ticks, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{ticks}`*\s*$", lines[i]):
            text = lines[i]
            body.append(text[indent:] if text[:indent].strip() == "" else text.lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"{file}:{start + 1}: unclosed code fence")
        i += 1  # the closing fence
        marker, reason = None, ""
        mk = _MARKER.match(lines[start - 1]) if start > 0 else None
        if mk is not None:
            body_m = _MARKER_BODY.match(mk.group(1))
            if body_m is None:
                raise ValueError(f"{file}:{start}: malformed marker {lines[start - 1].strip()!r}")
            marker = body_m.group(1).split("(")[0].strip()
            reason = (body_m.group("reason") or "").strip()
        blocks.append(Block(file, start + 1, lang, heading, "\n".join(body) + "\n", marker, reason))
    return blocks


def python_blocks() -> list[Block]:
    return [b for f in DOCS for b in parse(f) if b.runnable]


def chain(block: Block) -> list[Block]:
    """``block`` preceded by the blocks it continues (the python blocks of its file)."""
    same_file = [b for b in python_blocks() if b.file == block.file]
    k = same_file.index(block)
    start = k
    while same_file[start].marker == "continue":
        if start == 0:
            raise ValueError(f"{block.id}: 'continue' on the first python block of {block.file}")
        start -= 1
    return same_file[start : k + 1]


def as_run(block: Block) -> str:
    """The source that runs: the block itself, "cuda" -> "cpu" without CUDA (see above)."""
    src = block.source
    if DEVICE == "cpu":
        src = re.sub(r"""(["'])cuda\1""", r"\1cpu\1", src)
    return "\n" * block.line + src  # tracebacks name the markdown file's own line numbers


# ---------------------------------------------------------------------------- the reader's names


def _teacher_batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of (16, 8) inputs and (16, 4) targets of one fixed nonlinear teacher."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(8, 16, generator=g) / 8**0.5, torch.randn(16, 4, generator=g) / 4
    out = []
    for _ in range(n):
        x = torch.randn(16, 8, generator=g)
        out.append((x.to(DEVICE), (torch.tanh(x @ w1) @ w2).to(DEVICE)))
    return out


def _mlp(seed: int) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(DEVICE)


class _HalfNet(nn.Module):
    """An apex-era fp16 model: the MLP in fp16 and an fp32 output gain (as fp32 batch norm
    was), so FP16_Optimizer has masters for the fp16 params and steps the fp32 one directly."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.mlp = _mlp(seed).half()
        self.gain = nn.Parameter(torch.full((4,), 1.5, device=DEVICE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x.half()).float() * self.gain


def _loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reader's loss: mean squared error, computed in fp32 (as mixed-precision code does)."""
    return nn.functional.mse_loss(out.float(), y.float())


def _eval_loss(model: nn.Module, batches) -> float:
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        return sum(_loss_fn(model(x.to(dtype)), y).item() for x, y in batches) / len(batches)


class _FakeApex:
    """apex's era-2 scaler class under its module path while an apex-era file is written,
    then unregistered: the reader has an old checkpoint and no apex."""

    NAMES = ("apex", "apex.amp", "apex.amp.scaler")

    def __enter__(self):
        self.prior = {n: sys.modules[n] for n in self.NAMES if n in sys.modules}
        mods = {n: types.ModuleType(n) for n in self.NAMES}
        mods["apex"].amp, mods["apex.amp"].scaler = mods["apex.amp"], mods["apex.amp.scaler"]
        self.LossScaler = type("LossScaler", (), {"__module__": "apex.amp.scaler", "__qualname__": "LossScaler"})
        mods["apex.amp.scaler"].LossScaler = self.LossScaler
        sys.modules.update(mods)
        return self

    def __exit__(self, *exc):
        for n in self.NAMES:
            sys.modules.pop(n, None)
        sys.modules.update(self.prior)


def _write_apex_checkpoint(path: pathlib.Path) -> dict:
    """An apex-era (era-2) checkpoint of a trained fp16 model, as apex's FP16_Optimizer wrote
    it (its loss scaler pickled as an object). Returns what the reader should get back."""
    from fp16kit.legacy import FP16_Optimizer

    model = _HalfNet(seed=1)
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True, verbose=False
    )
    for x, y in _teacher_batches(3, seed=5):
        opt.zero_grad()
        opt.backward(_loss_fn(model(x), y))
        opt.step()
    with _FakeApex() as apex:
        scaler = apex.LossScaler()
        scaler.__dict__.update(
            dynamic=True,
            _loss_scale=512.0,
            _max_loss_scale=2.0**24,
            _min_loss_scale=None,
            _scale_seq_len=2000,
            _unskipped=7,
            _has_overflow=False,
            _overflow_buf=torch.IntTensor([0]),
        )
        optimizer_sd = {
            "loss_scaler": scaler,
            "dynamic_loss_scale": True,
            "overflow": False,
            "first_closure_call_this_step": True,
            "optimizer_state_dict": opt.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach().clone() for m in g] for g in opt.fp32_from_fp16_groups],
        }
        torch.save({"model": model.state_dict(), "optimizer": optimizer_sd}, path)
    return {"model": copy.deepcopy(model.state_dict()), "loss_scale": 512.0, "masters": optimizer_sd["fp32_from_fp16"]}


def _reader_names(file: str, tmp_path: pathlib.Path) -> tuple[dict, dict]:
    """The names a reader of ``file`` has when running its blocks, and facts for the checks.

    README.md (its blocks follow its first block, ``import torch, fp16kit``):
      torch, fp16kit   the README's imports
      model            a small fp32 MLP (nn.Sequential: 8 -> 32 -> 4) on the device
      loader           a list of 24 (x, y) batches, fp32, of one fixed teacher
      loss_fn          mean squared error in fp32
      optimizer        torch.optim.SGD(model.parameters(), lr=0.05)
      a default process group (gloo, 1 rank) for blocks that use torch.distributed
    MIGRATION.md (code that used apex.fp16_utils):
      model            the MLP in fp16 with an fp32 output gain (``_HalfNet``)
      optimizer        fp16kit.legacy.FP16_Optimizer(SGD(lr=0.1), static_loss_scale=128)
      loss1, loss2     two losses of the model (separate forward passes, not yet backpropagated)
      ./old.pt         an apex-era checkpoint (apex's pickled scaler inside); cwd is a tmp dir
    """
    facts: dict = {}
    if file == "README.md":
        model = _mlp(seed=0)
        loader = _teacher_batches(24, seed=3)
        names = {
            "torch": torch,
            "fp16kit": fp16kit,
            "model": model,
            "loader": loader,
            "loss_fn": _loss_fn,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.05),
        }
        facts["batches"] = loader
    elif file == "MIGRATION.md":
        from fp16kit.legacy import FP16_Optimizer

        model = _HalfNet(seed=0)
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0, verbose=False)
        ((x, y),) = _teacher_batches(1, seed=4)
        names = {
            "model": model,
            "optimizer": optimizer,
            "loss1": _loss_fn(model(x), y),  # two forward passes: two graphs
            "loss2": model(x).abs().mean(),
        }
        facts["old.pt"] = _write_apex_checkpoint(tmp_path / "old.pt")
        facts["batch"] = (x, y)
    else:
        raise AssertionError(file)
    return names, facts


# ---------------------------------------------------------------------------- claims

CLAIMS: dict[str, Callable[[dict, dict], None]] = {}


def claim(line: str):
    """Register a check for the one python block containing ``line`` (stripped)."""

    def register(fn):
        CLAIMS[line] = fn
        return fn

    return register


def _trained(ns: dict, facts: dict, dtype: torch.dtype) -> None:
    model, before = ns["model"], facts["model_before"]
    params = list(model.parameters())
    assert all(p.dtype == dtype for p in params), [p.dtype for p in params]
    assert any(not torch.equal(p, q) for p, q in zip(params, before.parameters())), "the params did not change"
    assert all(torch.isfinite(p).all() for p in params)
    start, end = _eval_loss(before, facts["batches"]), _eval_loss(model, facts["batches"])
    assert end < start, f"the loss did not decrease: {start} -> {end}"


@claim('with torch.autocast("cuda", dtype=torch.float16):')
def _autocast_loop_trains(ns, facts):
    _trained(ns, facts, torch.float32)  # autocast: fp32 params, fp16 compute
    assert ns["scaler"].get_scale() > 0


@claim('on_min_scale="raise",      # FloatingPointError if it overflows at the floor')
def _extras_as_commented(ns, facts):
    scaler = ns["scaler"]
    assert scaler._process_group is torch.distributed.group.WORLD is not None  # ranks skip together
    w = torch.ones(2, device=DEVICE, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    scales = []
    for _ in range(3):  # hysteresis=2: back off only at the second overflow
        opt.zero_grad()
        scaler.scale(w.sum() * float("inf")).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales[0] == 2.0**16 and scales[1] == 2.0**15, scales


@claim("model = model.half()")
def _fp16_model_trains_through_masters(ns, facts):
    _trained(ns, facts, torch.float16)
    masters = [p for g in ns["optimizer"].param_groups for p in g["params"]]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    for m, p in zip(masters, ns["model"].parameters()):
        assert torch.equal(m.half(), p)  # the model holds the masters, rounded


@claim("async_step=True)")
def _async_loop_trains(ns, facts):
    _trained(ns, facts, torch.float16)
    masters = [p for g in ns["optimizer"].param_groups for p in g["params"]]
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in masters)
    for m, p in zip(masters, ns["model"].parameters()):  # synchronize() landed the last step
        assert torch.equal(m.half().to(p.device), p)


@claim("optimizer.submit_step(lambda: (scaler.step(optimizer), optimizer.zero_grad()), scaler=scaler)")
def _submit_step_loop_trains(ns, facts):
    assert not ns["optimizer"].async_step
    _trained(ns, facts, torch.float16)
    assert ns["scaler"].skipped_steps() < len(facts["batches"])
    for m, p in zip([p for g in ns["optimizer"].param_groups for p in g["params"]], ns["model"].parameters()):
        assert torch.equal(m.half(), p)


@claim('ckpt = load_checkpoint("old.pt")             # no apex needed; tensors to CPU if no GPU')
def _apex_checkpoint_restored(ns, facts):
    saved = facts["old.pt"]
    assert "apex" not in sys.modules
    for k, v in ns["model"].state_dict().items():
        assert torch.equal(v, saved["model"][k]), k
    opt = ns["optimizer"]
    assert opt.loss_scale == saved["loss_scale"]
    for got, want in zip(opt.fp32_from_fp16_groups, saved["masters"]):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@claim("optimizer.update_master_grads()")
def _two_losses_step_on_their_sum(ns, facts):
    # The documented pattern steps every param on d(loss1 + loss2) -- plain backward() twice
    # would give the fp32 gain g1/S + g2 (S = 128). Reference: the same two losses from the
    # initial weights, backpropagated once, in fp16 as the model computes them.
    before, (x, y) = facts["model_before"], facts["batch"]
    ref = copy.deepcopy(before)
    (_loss_fn(ref(x), y) + ref(x).abs().mean()).backward()
    opt = ns["optimizer"]
    lr = opt.param_groups[0]["lr"]
    stepped = {id(p): m for ps, ms in zip(opt.fp16_groups, opt.fp32_from_fp16_groups) for p, m in zip(ps, ms)}
    names = [n for n, _ in before.named_parameters()]
    for n, p, r, q in zip(names, ns["model"].parameters(), ref.parameters(), before.parameters()):
        after = stepped.get(id(p), p)  # the master of an fp16 param, or the fp32 param itself
        torch.testing.assert_close(
            (q.float() - after) / lr, r.grad.float(), rtol=0.02, atol=2e-3, msg=lambda m, n=n: f"{n}: {m}"
        )


# ---------------------------------------------------------------------------- tests


def _finish(ns: dict, quiet: bool = False) -> None:
    """Land anything a block left in flight on the optimizer thread (``quiet``: while another
    error propagates, do not replace it with a step's error)."""
    for v in ns.values():
        if isinstance(v, fp16kit.MixedPrecisionOptimizer):
            try:
                v.synchronize()
            except Exception:
                if not quiet:
                    raise


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.id)
def test_doc_block_runs(block: Block, tmp_path, monkeypatch, request):
    if block.marker == "skip":
        pytest.skip(f"marked in {block.file}: {block.reason}")
    blocks = chain(block)
    monkeypatch.chdir(tmp_path)
    if any("torch.distributed" in b.source for b in blocks):
        request.getfixturevalue("gloo_world")
    ns, facts = _reader_names(block.file, tmp_path)
    try:
        for b in blocks:
            if b == block:
                facts["model_before"] = copy.deepcopy(ns.get("model"))
            exec(compile(as_run(b), str(ROOT / b.file), "exec"), ns)
    except BaseException:
        _finish(ns, quiet=True)
        raise
    _finish(ns)
    for line, check in CLAIMS.items():
        if line in (s.strip() for s in block.source.splitlines()):
            check(ns, facts)


def test_blocks_are_found():
    ids = [b.id for b in python_blocks()]
    assert len(ids) == len(set(ids))
    assert sum(b.file == "README.md" for b in python_blocks()) >= 5
    assert sum(b.file == "MIGRATION.md" for b in python_blocks()) >= 3
    langs = {b.lang for f in DOCS for b in parse(f)}
    assert "sh" in langs and "python" in langs  # shell blocks are seen, and not run


def test_markers_are_well_formed():
    """Every docs-test marker parses and sits right before a python fence; 'continue' has a
    python block before it in its file."""
    for file in DOCS:
        lines = (ROOT / file).read_text(encoding="utf-8").splitlines()
        marked = {b.line - 1 for b in parse(file) if b.marker is not None}
        for n, text in enumerate(lines, start=1):
            if "docs-test" in text:
                assert n in marked, f"{file}:{n}: a docs-test marker not parsed or not before a fence: {text!r}"
        for b in parse(file):
            if b.marker is not None:
                assert b.runnable, f"{b.id}: marker on a {b.lang or 'plain'} block"
                if b.marker == "continue":
                    chain(b)
                else:
                    assert b.reason, f"{b.id}: skip needs a reason"
    markers = [b for b in python_blocks() if b.marker is not None]
    assert len(markers) <= len(python_blocks()) // 2, "markers are meant to be rare"


def test_every_claim_matches_one_block():
    for line in CLAIMS:
        hits = [b.id for b in python_blocks() if line in (s.strip() for s in b.source.splitlines())]
        assert hits, f"no python block has the line {line!r}: update the claim with the docs"
        assert len(hits) == 1, (line, hits)
