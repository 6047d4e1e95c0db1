"""fp16kit's migration kit for apex-era code.

- :mod:`.apex_map`: the one table of apex (and Megatron-LM v1 ``fp16``) module paths -> fp16kit's;
- :mod:`.codemod`: ``fp16kit migrate``'s import rewriter (needs libcst: ``pip install "fp16kit[migrate]"``);
- :mod:`.files`: which files a migration walks, and rewriting them;
- :mod:`.alias`: ``install_apex_alias()``, an opt-in import hook mapping ``apex`` onto fp16kit.legacy
  (or, beside a real apex >= 25.x, only the modules it lacks: apex.amp, apex.fp16_utils);
- :mod:`.runner`: ``fp16kit run``, a script or ``-m`` module run as python would, with the alias.
"""

from __future__ import annotations

from ..legacy.apex_alias import apex_alias_installed, install_apex_alias, uninstall_apex_alias
from .runner import run_module, run_script

__all__ = ["apex_alias_installed", "install_apex_alias", "uninstall_apex_alias", "run_module", "run_script"]
