"""Ctrl-C and a step: a SIGINT that arrives while fp16kit commits a change is held until the change is whole.

CPython turns SIGINT into ``KeyboardInterrupt`` by running the Python-level SIGINT handler
(``signal.default_int_handler`` unless the program installed another) on the main thread,
between two bytecodes -- so without care it lands between any two lines of a step: after the
model grads were handed to the optimizer thread but before the job was queued, after the
wrapped optimizer moved the masters but before the step was recorded. A *commit* is the part
of a call that changes state; everything before it only checks and waits, so an interrupt
there changes nothing and the call can simply be repeated. The commit itself runs under
:func:`hold_interrupts`::

    with hold_interrupts("the optimizer step"):
        ...                 # SIGINT: recorded by a handler of ours, not raised
    # exit: the previous handler is back; a recorded SIGINT is handed to it now. The default
    # one raises KeyboardInterrupt, which gets the note COMPLETED + what: the call is done,
    # and repeating it would repeat the step (see completed()).

Contract:

* Only where a signal can arrive: on the main thread, with a Python handler installed. Off the
  main thread (the optimizer thread, a user's training thread) signals never arrive, and with
  ``SIG_IGN``/``SIG_DFL`` there is no Python handler to defer: both are no-ops.
* Holds nest: only the outermost one installs the handler and delivers; a second SIGINT
  abandons them all.
* A hold may span a wait for the previous asynchronous step (a step commits only once the
  one before it has landed): the first Ctrl-C then takes effect when the wait and the commit
  are done; a job that hangs is escaped with a second Ctrl-C.
* A second SIGINT during one hold is the user insisting: it raises at once, with the note
  ABANDONED + what (the change may be half made), after the ``on_abandon`` of every nested
  hold ran (so the owners refuse their next call instead of going on from half a change) and
  torch's grad mode was put back as it was when the hold began (the second SIGINT may land
  inside a ``torch.no_grad()`` entry, which then never exits). Only with the default handler:
  a handler of the program's own (a graceful stop that sets a flag) never raises, so it gets
  every held SIGINT when the hold ends instead.
* :func:`completed` also finds the note on a KeyboardInterrupt a second, late SIGINT raised
  while the first was being delivered (the first is its ``__context__``).
* A block that raised gets the RAISED note instead (the error is the interrupt's
  ``__context__``): a call may raise after it changed state, so it is over either way;
  :func:`completed` names it too.
* A :func:`commit`'s wrapper also notes a SIGINT that the restored handler raises just after
  the hold's exit returned (CPython checks for signals after that call). The one gap left: one
  that arrives in the two bytecodes after that check is raised in the caller, without the note.
"""

from __future__ import annotations

# the C functions: signal.signal's Python wrapper runs lines after the restore (typeshed has no stub)
import _signal  # type: ignore[import-not-found]
import functools
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["ABANDONED", "COMPLETED", "RAISED", "abandoned", "commit", "commit_methods", "completed", "hold_interrupts"]

COMPLETED = "fp16kit: Ctrl-C arrived during {what}; that was completed first, so it is done (do not repeat the call)."
RAISED = (
    "fp16kit: Ctrl-C arrived during {what}; that ran to its end first and raised the error in this "
    "interrupt's context (do not repeat the call: handle that error)."
)
ABANDONED = (
    "fp16kit: a second Ctrl-C arrived during {what}, which was left half done; "
    "reload the last checkpoint before training on."
)
_PREFIX = COMPLETED.split("{what}")[0]
_ABANDONED_PREFIX = ABANDONED.split("{what}")[0]


class _Held:
    """The handler installed by the outermost hold: records the first SIGINT, escalates on the second."""

    def __init__(self, what: str, on_abandon: Callable[[], None] | None, previous: Any) -> None:
        self.what = what
        self.previous = previous
        self.on_abandon = [] if on_abandon is None else [on_abandon]  # nested holds' too
        # the default handler: a second SIGINT breaks the hold
        self.escalates = previous is signal.default_int_handler
        self.grad_mode = torch.is_grad_enabled()
        self.frame: Any = None
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1 or not self.escalates:
            self.frame = self.frame or frame
            return
        # The hold is over: put the handler back first (this may run before the block's
        # exit restores it, or instead of it when the exit itself is where this lands).
        _signal.signal(signal.SIGINT, self.previous)
        for abandon in self.on_abandon:
            abandon()
        torch._C._set_grad_enabled(self.grad_mode)
        error = KeyboardInterrupt()
        _add_note(error, ABANDONED.format(what=self.what))
        raise error


class hold_interrupts:  # noqa: N801 - used as a context manager, named like one
    """Hold a SIGINT that arrives inside the block until the block is done (module docstring).

    ``what`` names the change for the note on the KeyboardInterrupt (``"the optimizer step"``);
    ``on_abandon`` runs if a second SIGINT breaks the hold. Put the ``with`` around the whole
    body of a call, its ``return`` inside: whatever runs after the hold (a decorator's exit)
    is outside it, and an interrupt there would not say that the call was completed."""

    __slots__ = ("what", "on_abandon", "held", "previous")

    def __init__(self, what: str, *, on_abandon: Callable[[], None] | None = None) -> None:
        self.what = what
        self.on_abandon = on_abandon
        self.held: _Held | None = None
        self.previous: Any = None

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only
        previous = _signal.getsignal(signal.SIGINT)
        if isinstance(previous, _Held):  # nested: the outer hold delivers (and abandons us too)
            if self.on_abandon is not None:
                previous.on_abandon.append(self.on_abandon)
            return
        if not callable(previous):
            return  # no Python handler to defer
        # Known before the install: a SIGINT just after it is held, and __exit__ must restore.
        self.previous, self.held = previous, _Held(self.what, self.on_abandon, previous)
        try:
            _signal.signal(signal.SIGINT, self.held)
        except ValueError:  # not the main interpreter: no signals here either
            self.held = None

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        held = self.held
        if held is None:
            return
        # One line: the restore and the check, so no line runs between them (a SIGINT at the
        # start of this line is still held). One that comes after the restore -- a second
        # Ctrl-C while the first is delivered, or a first one just then -- is raised by the
        # restored handler inside this try, and gets the note here.
        try:
            if _signal.signal(signal.SIGINT, self.previous) is held and held.count and (held.count == 1 or not held.escalates): _deliver(self.previous, held, exc_type is None)  # noqa: E701  # fmt: skip
        except KeyboardInterrupt as e:
            if completed(e) is None:
                _add_note(e, (COMPLETED if exc_type is None else RAISED).format(what=held.what))
            raise


# BaseException.add_note is Python 3.11+. There it is called as it is: a C method, no Python
# frame in which a second SIGINT could replace the noted interrupt. Before, the note goes where
# 3.11 keeps it (__notes__), which completed() and the legacy amp handle read.
if sys.version_info >= (3, 11):
    _add_note = BaseException.add_note
else:

    def _add_note(error: BaseException, note: str) -> None:
        setattr(error, "__notes__", [*getattr(error, "__notes__", ()), note])  # noqa: B010 (not in 3.10's stubs)


def commit(what: str, *, recovers: bool = False) -> Callable[[F], F]:
    """Decorate a method so that each call is one commit: its whole body runs under :func:`hold_interrupts`.

    If a second SIGINT breaks it, the object is marked, and every later commit of it raises RuntimeError
    naming the broken call -- except one with ``recovers`` (``load_state_dict``), which clears the mark and
    then calls the object's ``_recovered_from_interrupt()`` if it has one (to drop what the broken call left
    mid-way)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            ended = False
            try:
                with hold_interrupts(what, on_abandon=lambda: self.__dict__.__setitem__(_BROKEN, what)):
                    # Refused while marked broken -- on the main thread: a job the user queued
                    # before the break runs to its end on the optimizer thread, so the state is
                    # the one the break left, not one with a failed job in it.
                    if _BROKEN not in self.__dict__ or threading.current_thread() is not threading.main_thread():
                        result = fn(self, *args, **kwargs)
                        ended = True
                        return result
                    if not recovers:
                        raise RuntimeError(
                            _BROKEN_MESSAGE.format(what=self.__dict__[_BROKEN], name=type(self).__name__)
                        )
                    broken = self.__dict__.pop(_BROKEN)  # (its own inner commits run unrefused)
                    try:
                        result = fn(self, *args, **kwargs)
                    except BaseException:
                        self.__dict__[_BROKEN] = broken  # a refused checkpoint restores nothing
                        raise
                    getattr(self, "_recovered_from_interrupt", lambda: None)()
                    ended = True
                    return result
            except KeyboardInterrupt as e:
                # A SIGINT after the restore's last signal check is raised here, when the
                # hold's exit returns: the call is done, say so (the caller cannot tell).
                if ended and completed(e) is None:
                    _add_note(e, COMPLETED.format(what=what))
                raise

        return call  # type: ignore[return-value]

    return decorate


def commit_methods(cls: type, commits: dict[str, str], *, recovers: tuple[str, ...] = ()) -> None:
    """Make each method ``name`` of ``cls`` one :func:`commit` described by ``commits[name]``.

    ``recovers``: the methods that clear a broken commit's mark."""
    for name, what in commits.items():
        setattr(cls, name, commit(what, recovers=name in recovers)(getattr(cls, name)))


_BROKEN = "_interrupted_commit"
_BROKEN_MESSAGE = (
    "A second Ctrl-C broke off {what} half way, so this {name}'s state is part old, part new. "
    "Restore it from the last checkpoint (load_state_dict) before using it again."
)


def _deliver(handler: Callable[[int, Any], Any], held: _Held, done: bool) -> None:
    """Hand the held SIGINTs to ``handler``; a KeyboardInterrupt it raises says COMPLETED when
    the block ran to its end, RAISED when it ended with an error (``done`` False): a call may
    raise after it changed state (``update()`` at a floor with ``on_min_scale="raise"``), so
    either way the call is over and must not be repeated."""
    try:
        for _ in range(held.count):  # (more than one only for a handler that does not raise)
            handler(signal.SIGINT, held.frame)
    except KeyboardInterrupt as e:
        _add_note(e, (COMPLETED if done else RAISED).format(what=held.what))
        raise


def abandoned(error: BaseException) -> bool:
    """Is ``error`` the KeyboardInterrupt of a second Ctrl-C that broke a hold (the user insisting on stopping)?"""
    notes = getattr(error, "__notes__", ()) if isinstance(error, KeyboardInterrupt) else ()
    return any(isinstance(n, str) and n.startswith(_ABANDONED_PREFIX) for n in notes)


def completed(error: BaseException) -> str | None:
    """Say what a KeyboardInterrupt held by fp16kit reports as completed before it was raised.

    A string: the call it came from did its work (go on with the next one); or None: nothing was changed by
    the interrupted call, which may be repeated."""
    seen: BaseException | None = error
    while isinstance(seen, KeyboardInterrupt):
        for note in getattr(seen, "__notes__", ()):
            if isinstance(note, str) and note.startswith(_PREFIX):
                return note[len(_PREFIX) :].split("; that ", 1)[0]
        seen = seen.__context__
    return None
