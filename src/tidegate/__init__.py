"""tidegate: a gateway for services that call LLMs, and a virtual-time lab that runs its policies."""

__version__ = "0.1.0"

__all__ = ["__version__"]
