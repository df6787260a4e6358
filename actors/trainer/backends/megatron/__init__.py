"""The `megatron` training backend (megatron-core `GPTModel`, TP x PP x DP) and its HF weight conversion.

`backend` holds `MegatronBackend`; `convert` the HF <-> Megatron layouts and TP shards; `model` the
`GPTModel` construction; `parallel` the process groups; `stages` the pipeline transfers; `cpu_compat`
every CPU adjustment; `experts` the MoE experts' names; `replay` routing replay on its routers. Importing
this package needs the ``megatron`` extra (megatron-core); `build_backend` imports it only when
``trainer.backend`` is ``megatron``.
"""

from __future__ import annotations

from actors.trainer.backends.megatron.backend import MegatronBackend

__all__ = ["MegatronBackend"]
