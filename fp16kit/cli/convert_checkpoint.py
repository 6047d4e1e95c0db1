"""``fp16kit convert-checkpoint IN OUT``: an apex-era checkpoint -> a plain-data file.

``fp16kit convert-checkpoint IN OUT``: an apex-era checkpoint -> a file
``torch.load(OUT, weights_only=True)`` reads (the work is :func:`fp16kit.legacy.checkpoints.convert.convert_file`).

Prints one line per converted (or deliberately kept) item, then where it wrote. An error is one
line on stderr, this command's own words naming the fix (its options, never Python arguments
or torch's advice), from the kind of the library's error. Exit codes:

- 0: OUT written (checked to load with ``torch.load(weights_only=True)``);
- 1: IN not converted -- refused (a crafted pickle or an unknown class, a whole pickled model
  or optimizer, not a checkpoint, a TorchScript archive, a newer pickle protocol, truncated or
  corrupt, a structure no checkpoint has, an apex scaler without its attributes), missing, a
  folder or unreadable -- or OUT could not be written (a full disk); nothing written;
- 2: usage -- bad arguments, a ``--map-location`` that is not a device of this machine, OUT's
  folder missing, OUT a folder, OUT exists, or OUT is IN (``--force`` allows the last two);
  nothing written.
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import sys
import warnings
from typing import Any

_EPILOG = """\
exit codes: 0 written; 1 IN refused or unreadable, or OUT not writable (nothing written);
2 bad usage, --map-location not a device here, OUT's folder missing, OUT a folder, OUT exists
or OUT is IN without --force (nothing written). OUT is written to a temporary file, checked to
load with torch.load(weights_only=True), then renamed: IN is never touched unless OUT is IN and
--force.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-checkpoint",
        help="make an apex checkpoint load with weights_only=True",
        description="Read IN with fp16kit.legacy.load_checkpoint (apex and Megatron-LM v1 loss scalers, "
        "argparse.Namespace args, numpy RNG state; crafted pickles are refused and nothing in them runs), "
        "convert what is not plain data and write OUT: apex scalers become fp16kit's scaler state, "
        "Namespaces dicts, numpy arrays tensors, tensors saved on a GPU land on --map-location.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", metavar="IN", help="the checkpoint to read (never modified)")
    p.add_argument("output", metavar="OUT", help="where to write the converted checkpoint")
    p.add_argument(
        "--map-location", default="cpu", metavar="DEVICE", help="where tensors go (torch's map_location; default: cpu)"
    )
    p.add_argument(
        "--torch-optimizer-state",
        action="store_true",
        help="move apex FusedAdam/FusedLAMB's per-group 'step' into each param's state "
        "(float32 tensor), as torch.optim.Adam/AdamW expect; give FusedAdagrad's state the step "
        "and lr_decay torch.optim.Adagrad needs",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (even when it is IN)")
    p.set_defaults(func=_run)


def _error(message: str, code: int) -> int:
    # one line, whatever it quotes (a file name, or a record's, holding a newline)
    one_line = message.replace("\r", "\\r").replace("\n", "\\n")
    print(f"fp16kit convert-checkpoint: error: {one_line}", file=sys.stderr)
    return code


def _device_problem(location: str) -> str:
    """Why ``--map-location`` cannot be used on this machine ("" when it can)."""
    import torch

    try:
        device = torch.device(location)
    except (RuntimeError, ValueError):
        return f"--map-location {location} is not a device: give cpu (the default), cuda or cuda:N"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--map-location {location}: this machine has no CUDA; leave the option out (the default is cpu)"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"--map-location {location}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return ""


def _refused(e: Any, src: str) -> str:
    """One sentence per kind of file load_checkpoint refuses (CheckpointRefused.kind), naming the fix."""
    what = e.subject
    if e.kind == "whole":
        obj = "model" if e.whole == "module" else "optimizer"
        return (
            f"{src} holds a whole pickled {obj} ({what}), not its state_dict(); nothing in it ran. If you "
            "trust the file, re-save its state_dict() once where its classes import, and convert that file."
        )
    if e.kind == "global":
        return (
            f"{src} pickles {what}, which no checkpoint of state dicts holds; nothing in it ran. If you trust "
            "the file, re-save its state dicts where that code is installed, and convert that file."
        )
    if e.kind == "not_torch":
        return f"{src} is not a checkpoint written by torch.save: {what}. Check that it is the file you meant."
    if e.kind == "damaged":
        return f"{src} is truncated or corrupt: {what}. Copy it again from the original."
    if e.kind == "protocol":
        return (
            f"{src} was saved with pickle protocol {what}, which torch's safe reader does not read. Re-save it "
            "with torch.save's default protocol where it loads, and convert that file."
        )
    if e.kind == "not_file":
        if what == "a directory":
            return f"{src} is a directory; give the checkpoint file in it."
        return f"{src} is {what}, not a regular file (reading it could wait forever): give the checkpoint file."
    if e.kind == "legacy_tar":
        return (
            f"{src} is in torch's legacy tar format (torch < 0.4), which torch's safe reader does not read. If "
            "you trust it, load it with torch.load(..., weights_only=False), save its state dicts, and convert that."
        )
    if e.kind == "torchscript":
        return f"{src} is a TorchScript archive (torch.jit.save), not a checkpoint: load it with torch.jit.load."
    return f"{src} was not converted: {what}."


_OUTPUT = {
    "exists": "{out} exists; choose another name, or pass --force to replace it.",
    "is_input": "{out} is IN; write the converted checkpoint elsewhere, or pass --force to replace IN once converted.",
    "is_directory": "{out} is a directory; name the file to write in it, e.g. {example}.",
    "not_regular": "{out} is not a regular file (a FIFO, a device or a socket); name a file to write, --force or not.",
}

# torch warns before it fails on these; the error then says what to do
_TORCH_WARNINGS = r"(Detected pickle protocol|'torch.load' received a zip file that looks like a TorchScript)"


def _run(args: argparse.Namespace) -> int:
    from ..legacy.checkpoints.convert import ConversionError, OutputRefused, WriteError, convert_file
    from ..legacy.checkpoints.errors import CheckpointRefused, torch_words

    src, out = args.input, pathlib.Path(args.output)
    problem = _device_problem(args.map_location)
    if problem:
        return _error(problem, 2)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_TORCH_WARNINGS, category=UserWarning)
            report = convert_file(
                src,
                out,
                map_location=args.map_location,
                torch_optimizer_state=args.torch_optimizer_state,
                overwrite=args.force,
            )
    except OutputRefused as e:
        return _error(_OUTPUT[e.reason].format(out=out, example=out / pathlib.Path(src).name), 2)
    except NotADirectoryError as e:
        if not out.parent.is_dir():
            return _error(f"{out.parent} is not a directory: create it first, or write {out.name} elsewhere.", 2)
        return _error(f"{src} cannot be read: {e.strerror or e}.", 1)
    except WriteError as e:
        return _error(str(e), 1)
    except CheckpointRefused as e:
        return _error(_refused(e, src), 1)
    except ConversionError as e:
        return _error(f"{src} was not converted: {e.where}: {e.why}.", 1)
    except FileNotFoundError:
        return _error(f"{src}: no such file.", 1)
    except IsADirectoryError:
        return _error(f"{src} is a directory; give the checkpoint file in it.", 1)
    except PermissionError:
        return _error(f"{src} cannot be read: permission denied.", 1)
    except (pickle.UnpicklingError, OSError, ValueError, RuntimeError) as e:
        return _error(f"{src} was not converted: {type(e).__name__}: {torch_words(e)}", 1)
    print(f"{src} -> {out}")
    for item in report:
        print(f"  {item}")
    if not report:
        print("  nothing to convert: the file held plain data only; re-saved as it was")
    print(f"wrote {out}: torch.load({str(out)!r}, weights_only=True) reads it")
    return 0
