"""fp16kit inside the frameworks people train with: one small adapter module per framework.

* :mod:`fp16kit.integrations.lightning` -- a Lightning precision plugin for fp32 master weights
  (``pip install "fp16kit[lightning]"``);
* :mod:`fp16kit.integrations.accelerate` -- an ``Accelerator`` whose clipping, skipped-step
  detection and ``save_state``/``load_state`` know about master weights
  (``pip install "fp16kit[accelerate]"``);
* :mod:`fp16kit.integrations.transformers` -- the Transformers ``Trainer`` recipe built on it
  (``pip install "fp16kit[transformers]"``).

DDP and FSDP2 need no adapter: see the README's "Use with ..." section.

Importing this package imports no framework; each submodule imports its own framework when it is
imported (and says which extra to install when it is missing).
"""

__all__: list[str] = []
