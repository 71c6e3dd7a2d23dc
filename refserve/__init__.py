"""refserve: a readable reference implementation of LLM inference serving."""
