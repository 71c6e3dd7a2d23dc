"""refserve: a readable reference implementation of LLM inference serving.

    from refserve import LLM, SamplingParams       # vLLM's names: swap the import to move up
"""

from refserve.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "RequestOutput",
           "CompletionOutput", "TextPrompt", "TokensPrompt"]


def __getattr__(name):
    # Import the engine lazily: `import refserve` stays cheap for the data-structure modules.
    if name == "LLM":
        from refserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from refserve.engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from refserve.config import EngineConfig
        return EngineConfig
    if name in ("RequestOutput", "CompletionOutput"):
        from refserve import outputs
        return getattr(outputs, name)
    if name in ("TextPrompt", "TokensPrompt"):
        from refserve import inputs
        return getattr(inputs, name)
    raise AttributeError(f"module 'refserve' has no attribute {name!r}")
