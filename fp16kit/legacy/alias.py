"""``fp16kit.legacy.install_apex_alias()``: run apex-era code unmodified (``import apex`` resolves to
fp16kit.legacy; beside a real apex >= 25.x, which lacks apex.amp / apex.fp16_utils, ``import apex``
stays the real one and only the modules it lacks are fp16kit.legacy's). The hook itself lives in
:mod:`fp16kit.migrate.alias`."""

from __future__ import annotations

from ..migrate.alias import apex_alias_installed, install_apex_alias, uninstall_apex_alias

__all__ = ["apex_alias_installed", "install_apex_alias", "uninstall_apex_alias"]
