"""Which kernels a model is built with, decided without building anything: the module backend (`te`: Transformer
Engine, `local`: megatron's own modules), the core attention and the MoE experts.

Pure choices on names (no megatron import; Transformer Engine is imported only to ask whether it is installed), so
the config rules, the run set-up (`megagate.run_setup`), `--dry-run` and the layer specs (`megagate.model.spec`)
share one table:

    "auto" backend        te where a GPU and Transformer Engine are present, else local
    "auto" core attention te under backend te, else sdpa (torch's fused kernels; on CPU too)
"""

from __future__ import annotations

from megagate.errors import ConfigError

BACKENDS = ("local", "te")
CORE_ATTENTIONS = ("auto", "sdpa", "local", "te")


def transformer_engine_available() -> bool:
    """True when Transformer Engine's PyTorch modules import."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a CUDA/driver error raised while loading TE's library
        return False
    return True


def check_backend(backend: str) -> None:
    """Refuse unknown backends, and 'te' where Transformer Engine is not installed."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "te" and not transformer_engine_available():
        raise ConfigError(
            "backend='te' needs Transformer Engine, which is not installed (pip install -e '.[te]' on a CUDA "
            "machine); use backend='local'"
        )


def resolve_backend(choice: str, *, gpu: bool, te: bool) -> str:
    """The backend that `choice` ("auto" | "local" | "te") means on a machine with (`gpu`, `te`: TE installed)."""
    if choice != "auto":
        return choice
    return "te" if gpu and te else "local"


def resolve_core_attention(backend: str, choice: str = "auto") -> str:
    """The core-attention kernel that `choice` means under `backend`: "te", "local" or "sdpa" (one-line
    ConfigError for an unknown choice, or "te" without backend te)."""
    if choice not in CORE_ATTENTIONS:
        raise ConfigError(f"core_attention={choice!r} is not one of {', '.join(CORE_ATTENTIONS)}")
    if choice == "auto":
        return "te" if backend == "te" else "sdpa"
    if choice == "te" and backend != "te":
        raise ConfigError(
            f"core_attention='te' needs backend='te' (got backend={backend!r}); use core_attention='sdpa' or 'local'"
        )
    return choice


def core_attention_name(backend: str, choice: str = "auto", cuda: bool | None = None) -> str:
    """A one-line description of the core attention that will run, for `--dry-run`: the resolved kernel, and for
    sdpa on CUDA the torch SDPA backends enabled in this process."""
    kernel = resolve_core_attention(backend, choice)
    if kernel == "te":
        return "te (Transformer Engine DotProductAttention)"
    if kernel == "local":
        return "local (megatron DotProductAttention, materialises [b, np, sq, sk] probabilities)"
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if cuda:
        from megagate.model.core_attention import enabled_sdpa_backends

        return f"sdpa (torch scaled_dot_product_attention; CUDA backends enabled: {', '.join(enabled_sdpa_backends())})"
    return "sdpa (torch scaled_dot_product_attention; CPU flash kernel)"


def experts_name(backend: str, grouped: bool) -> str:
    """The MoE expert implementation the spec builds (for `--dry-run`)."""
    if not grouped:
        return "SequentialMLP (megatron's loop over the local experts)"
    if backend == "te":
        return "TEGroupedMLP (Transformer Engine's grouped GEMM)"
    return "TorchGroupedMLP (torch grouped_mm)"
