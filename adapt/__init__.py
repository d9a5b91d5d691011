"""adapt: learned scheduling components as versioned models, replayed offline and hot-swapped into vLLM."""

__version__ = "0.1.0"
