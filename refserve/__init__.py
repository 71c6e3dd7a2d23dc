"""refserve: a readable reference implementation of LLM inference serving.

    from refserve import LLM, SamplingParams
"""

from refserve.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig"]


def __getattr__(name):
    # Import the engine lazily: `import refserve` stays cheap for the data-structure modules.
    if name in ("LLM", "LLMEngine"):
        from refserve import engine
        return getattr(engine, name)
    if name == "EngineConfig":
        from refserve.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'refserve' has no attribute {name!r}")
