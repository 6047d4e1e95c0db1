"""``fp16kit migrate``: rewrite apex imports to fp16kit.legacy in place (or show / check what would change)."""

from __future__ import annotations

import argparse
import sys

_DESCRIPTION = """\
Rewrite every import of an apex module that fp16kit covers -- `import apex`, `import apex.amp as
amp`, `from apex import amp`, `from apex.fp16_utils import FP16_Optimizer as Opt`, `from
apex.optimizers import FusedAdam`, star imports, submodules, and dotted uses such as
`apex.parallel.DistributedDataParallel(...)` -- to fp16kit.legacy, in place. Every other byte of
the file stays as it was (comments, layout, line endings, encoding); running it twice changes
nothing the second time. Folders are walked for Python files (hidden folders, virtual
environments and site-packages are skipped, and so is a vendored copy of apex itself -- a folder
named apex with apex's own subpackages -- whose imports must stay apex's; it is listed). A file
named on the command line that is not Python (*.py, *.pyw, *.pyi, a #!...python script) is listed
as skipped. apex's amp_C and apex_C extension modules become fp16kit's stand-ins. Availability
checks and dynamic imports that name a covered module -- `'apex' in sys.modules`,
importlib.util.find_spec("apex.amp"), pkgutil.find_loader, importlib.import_module("apex"),
hasattr(apex, "amp") -- get the name the import rewrite gives it, so they find what the imports
now import. What cannot be migrated (apex modules and extensions fp16kit does not cover, module
names built at run time, strings naming apex paths, importlib.metadata.version("apex") and
other reads of apex's distribution metadata, transformers' is_apex_available) is left as it is
and listed as FILE:LINE: message, with the closest replacement. So is each torch.load that
resumes an apex FP16_Optimizer's state (its pickled loss scaler needs apex, or the alias of
`fp16kit run`): convert those old checkpoints once with `fp16kit convert-checkpoint OLD NEW`.

It never harms the tree: nothing outside the PATHs is written (a symlinked folder inside them is
walked once, one pointing outside them or back to a folder holding it is listed and not followed;
a symlinked file whose target is outside is listed and left); a rewritten file keeps its owner,
group, mode and extended attributes and is replaced atomically, and only if it is still what was
read (an edit saved meanwhile is kept: the file is listed as changed while migrating). Left as
they are and listed, each as PATH: reason: hard-linked files (--write-hard-links), read-only files
(--write-read-only), files over --max-size, and files the parser cannot handle; the run goes on
with the others."""

_EPILOG = """\
exit status:
  0  done (with --check: nothing would change)
  1  --check: some file would change
  2  bad arguments, a PATH that does not exist, or libcst missing
  3  some file could not be processed (the others were): not read, decoded, parsed or written,
     over --max-size, changed while migrating, a symlink out of the PATHs, or hard-linked or
     read-only without --write-hard-links / --write-read-only; each is listed as PATH: reason,
     and the summary says how many (3 wins over 1 with --check)"""


def register(sub: argparse._SubParsersAction) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="rewrite apex imports to fp16kit.legacy",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    migrate.add_argument("paths", nargs="+", metavar="PATH", help="Python files or folders to migrate")
    migrate.add_argument("--diff", action="store_true", help="print a unified diff; write nothing")
    migrate.add_argument("--check", action="store_true", help="write nothing; exit 1 if any file would change")
    migrate.add_argument(
        "--megatron",
        action="store_true",
        help="also rewrite Megatron-LM v1's `fp16` / `megatron.fp16` package to fp16kit.legacy.megatron",
    )
    migrate.add_argument(
        "--max-size",
        type=_size,
        default=None,
        metavar="BYTES",
        help=f"skip (and list) files larger than this; default {_DEFAULT_MAX_SIZE} (1 MiB): a generated file of "
        "a few MB takes minutes and gigabytes to parse",
    )
    migrate.add_argument(
        "--write-hard-links",
        action="store_true",
        help="rewrite a hard-linked file in place, the same inode, so all its names see the change (not atomic); "
        "without it such a file is listed and left, since a rewrite would split it from its other names",
    )
    migrate.add_argument(
        "--write-read-only",
        action="store_true",
        help="rewrite read-only files too (the mode stays read-only); without it they are listed and left",
    )
    migrate.set_defaults(func=_migrate)


_DEFAULT_MAX_SIZE = 1 << 20  # fp16kit.migrate.files.DEFAULT_MAX_SIZE (this module must import without libcst)


def _size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes: {text!r}")
    return value


def _migrate(args: argparse.Namespace) -> int:
    try:
        from ..migrate.files import VENDORED_APEX, given_roots, iter_python_files, migrate_file
    except ModuleNotFoundError as e:
        if e.name != "libcst":
            raise
        print('fp16kit migrate needs libcst: pip install "fp16kit[migrate]"', file=sys.stderr)
        return 2
    skipped: list[tuple[str, str]] = []
    try:
        files = list(iter_python_files(args.paths, skipped))
    except FileNotFoundError as e:
        print(f"fp16kit migrate: {e}", file=sys.stderr)
        return 2
    roots = given_roots(args.paths)
    max_size = _DEFAULT_MAX_SIZE if args.max_size is None else args.max_size
    write = not (args.diff or args.check)
    report = sys.stderr if args.diff else sys.stdout  # with --diff, stdout is a patch and nothing else
    for path, why in skipped:
        print(f"{path}: {why}", file=report)
    changed = imports = uses = checks = left = failed = 0
    for path in files:
        outcome = migrate_file(
            path,
            megatron=args.megatron,
            write=write,
            diff=args.diff,
            roots=roots,
            max_size=max_size,
            write_hard_links=args.write_hard_links,
            write_read_only=args.write_read_only,
        )
        if outcome.error is not None:
            failed += 1
            where = f"{path}:{outcome.error_line}" if outcome.error_line else path  # no line for read/write errors
            print(f"{where}: {outcome.error}; file skipped", file=sys.stderr)
            continue
        if outcome.diff:
            _write_bytes(outcome.diff)
        changed += outcome.changed
        imports += outcome.imports_rewritten
        uses += outcome.uses_rewritten
        checks += outcome.checks_rewritten
        for problem in outcome.unmigratable:
            left += 1
            print(f"{path}:{problem.line}: {problem.message}", file=report)
    verb = "rewritten" if write else "would be rewritten"
    counts = f"{imports} import{'s' * (imports != 1)}, {uses} dotted use{'s' * (uses != 1)}"
    if checks:
        counts += f", {checks} availability check{'s' * (checks != 1)}"
    summary = f"{changed} of {len(files)} Python file{'s' * (len(files) != 1)} {verb} ({counts})"
    if left:
        summary += f"; {left} use{'s' * (left != 1)} of apex left for you (listed above)"
    if failed:
        summary += f"; {failed} file{'s' * (failed != 1)} could not be processed (listed above)"
    vendored = sum(why == VENDORED_APEX for _, why in skipped)
    if vendored:
        summary += f"; {vendored} vendored apex folder{'s' * (vendored != 1)} skipped (listed above)"
    links = sum(why.startswith("a symlink") for _, why in skipped)
    if links:
        summary += f"; {links} symlink{'s' * (links != 1)} not followed (listed above)"
    others = len(skipped) - vendored - links
    if others:
        summary += f"; {others} named path{'s' * (others != 1)} skipped, not Python (listed above)"
    print(summary, file=report)
    if failed:
        return 3
    return 1 if args.check and changed else 0


def _write_bytes(data: bytes) -> None:
    """A diff goes out in its file's own bytes (a latin-1 or BOM file's patch must match that file)."""
    sys.stdout.flush()
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:  # a text-only stream (a StringIO in place of stdout)
        sys.stdout.write(data.decode("utf-8", errors="surrogateescape"))
        return
    buffer.write(data)
    buffer.flush()
