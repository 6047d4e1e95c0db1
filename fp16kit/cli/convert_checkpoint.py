"""``fp16kit convert-checkpoint IN OUT``: an apex-era checkpoint -> a file
``torch.load(OUT, weights_only=True)`` reads (the work is :func:`fp16kit.legacy.convert.convert_file`).

Prints one line per converted (or deliberately kept) item, then where it wrote. Exit codes:

- 0: OUT written (checked to load with ``torch.load(weights_only=True)``);
- 1: IN not converted -- refused (a crafted pickle, a whole pickled model, not a checkpoint,
  truncated or corrupt), missing or unreadable -- or OUT could not be written (a full disk);
  nothing written;
- 2: usage -- bad arguments, OUT's folder missing, OUT a folder, OUT exists, or OUT is IN
  (``--force`` allows the last two); nothing written.
"""

from __future__ import annotations

import argparse
import pickle
import sys

_EPILOG = """\
exit codes: 0 written; 1 IN refused or unreadable, or OUT not writable (nothing written); 2 bad usage, OUT's folder
missing, OUT a folder, OUT exists or OUT is IN without --force (nothing written). OUT is written to a temporary file, checked to load
with torch.load(weights_only=True), then renamed: IN is never touched unless OUT is IN and --force.
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
    p.add_argument("--map-location", default="cpu", metavar="DEVICE",
                   help="where tensors go (torch's map_location; default: cpu)")
    p.add_argument("--torch-optimizer-state", action="store_true",
                   help="move apex FusedAdam/FusedLAMB's per-group 'step' into each param's state "
                   "(float32 tensor), as torch.optim.Adam/AdamW expect; give FusedAdagrad's state the step "
                   "and lr_decay torch.optim.Adagrad needs")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (even when it is IN)")
    p.set_defaults(func=_run)


def _error(message: str, code: int) -> int:
    print(f"fp16kit convert-checkpoint: error: {message}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace) -> int:
    from ..legacy.convert import WriteError, convert_file

    try:
        report = convert_file(
            args.input,
            args.output,
            map_location=args.map_location,
            torch_optimizer_state=args.torch_optimizer_state,
            overwrite=args.force,
        )
    except (FileExistsError, NotADirectoryError) as e:
        return _error(str(e), 2)
    except WriteError as e:
        return _error(str(e), 1)
    except (pickle.UnpicklingError, OSError, ValueError, RuntimeError) as e:
        hint = ""
        if isinstance(e, RuntimeError) and "torch.cuda.is_available() is False" in str(e):
            # torch's text names torch.load's argument, not this command's option
            hint = f"\nThis machine has no CUDA: leave out --map-location {args.map_location} (the default is cpu)."
        return _error(f"{args.input} was not converted, nothing was written:\n{e}{hint}", 1)
    print(f"{args.input} -> {args.output}")
    for item in report:
        print(f"  {item}")
    if not report:
        print("  nothing to convert: the file held plain data only; re-saved as it was")
    print(f"wrote {args.output}: torch.load({args.output!r}, weights_only=True) reads it")
    return 0
