"""``fp16kit.legacy.install_apex_alias()``: run apex-era code unmodified.

``import apex`` resolves to fp16kit.legacy; beside a real apex >= 25.x, which lacks apex.amp /
apex.fp16_utils, ``import apex`` stays the real one and only the modules it lacks are
fp16kit.legacy's.

- :mod:`.finder` -- the import hook (a ``sys.meta_path`` finder) and its install/uninstall;
- :mod:`.apex_map` -- which apex module is which fp16kit.legacy module;
- :mod:`.distribution` -- finding a real apex distribution to complement.
"""

from .finder import apex_alias_installed, install_apex_alias, uninstall_apex_alias

__all__ = ["apex_alias_installed", "install_apex_alias", "uninstall_apex_alias"]
