"""apex_C's flatten/unflatten: torch's own, reachable as `import apex_C` under the alias."""

from __future__ import annotations

import torch

from fp16kit.legacy import apex_c
from fp16kit.legacy.apex_alias import install_apex_alias, uninstall_apex_alias
from fp16kit.migrate.codemod import migrate_source


def test_flatten_then_unflatten_gives_the_tensors_back():
    ts = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    flat = apex_c.flatten(ts)
    assert flat.shape == (12,) and torch.equal(flat, torch.cat([t.reshape(-1) for t in ts]))
    for a, b in zip(apex_c.unflatten(flat, ts), ts):
        assert torch.equal(a, b)


def test_import_apex_C_under_the_alias_and_after_migrate():
    install_apex_alias()
    try:
        import apex_C  # noqa: N813

        assert apex_C is apex_c
    finally:
        uninstall_apex_alias()
    out = migrate_source("import apex_C\nbuf = apex_C.flatten(grads)\n")
    assert out.code == "import fp16kit.legacy.apex_c\nbuf = fp16kit.legacy.apex_c.flatten(grads)\n"
    assert not out.unmigratable
