from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from raycl.export.encoder import load_encoder


def __getattr__(name: str) -> Any:
    # raycl.load_encoder without importing torch at `import raycl` (kept light).
    if name == "load_encoder":
        from raycl.export.encoder import load_encoder

        return load_encoder
    raise AttributeError(f"module 'raycl' has no attribute {name!r}")


__all__ = ["__version__", "load_encoder"]
