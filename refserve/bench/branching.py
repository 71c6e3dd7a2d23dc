"""The four branching workloads of `bench prefix`: prompts that share prefixes in a tree.

Every prompt is a list of token ids, a function of (workload, size, seed, vocab) only, so
every policy of one run sees the very same requests. Answers and tool results inside a
history are drawn tokens too (a client resending a transcript resends text it already has;
what matters to a prefix cache is only which tokens repeat):

    few-shot     an instruction, then a prefix of a fixed list of worked examples (each
                 prompt takes the first j of them, j varying), then its own question:
                 prompts share the instruction and their first examples, then diverge
    multi-turn   C conversations; turn t resends the system prompt, the t - 1 earlier
                 (question, answer) pairs and a new question: a chain per conversation
    branches     one long stem (a problem statement), k branches off it (a thought each),
                 and two continuations off every branch: a tree of depth 2
                 (tree-of-thought sampling)
    agent loop   one transcript (tool descriptions, a task) re-sent after every step with
                 the step's action and tool output appended: a single growing chain

`Branching.distinct_tokens` counts the tokens of the union of the prompts' prefix trees:
what a cache that never evicted would have to compute at least (the first-time cost).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("few-shot", "multi-turn", "branches", "agent loop")


@dataclass
class Branching:
    name: str
    prompts: list[list[int]]  # in their natural (dependency) order

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def distinct_tokens(self) -> int:
        """Tokens of the union of all prompts as a trie: each shared prefix counted once."""
        root: dict = {}
        count = 0
        for prompt in self.prompts:
            node = root
            for token in prompt:
                if token not in node:
                    node[token] = {}
                    count += 1
                node = node[token]
        return count


def make_branching(name: str, scale: int, seed: int, vocab_size: int) -> Branching:
    """Workload `name` (one of WORKLOADS). `scale` sets the pieces' sizes: about `scale`
    tokens per example, turn, branch or step, and 2-3 x scale for instructions and stems."""
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    rng = np.random.default_rng([seed, WORKLOADS.index(name)])
    low = min(1000, vocab_size // 2)  # the ordinary part of the vocabulary

    def text(n: int) -> list[int]:
        return rng.integers(low, vocab_size, size=max(1, int(n))).tolist()

    prompts: list[list[int]] = []
    if name == "few-shot":
        instruction = text(2 * scale)
        examples = [text(scale) for _ in range(6)]
        for i in range(12):
            shots = int(rng.integers(1, len(examples) + 1))
            prompts.append(instruction + sum(examples[:shots], []) + text(scale // 4 + i % 3))
    elif name == "multi-turn":
        for _ in range(3):
            history = text(2 * scale)  # the system prompt
            for _ in range(4):
                question = text(scale // 2)
                prompts.append(history + question)
                history = history + question + text(scale // 2)  # + the answer
    elif name == "branches":
        stem = text(3 * scale)
        for _ in range(4):
            thought = text(scale)
            for _ in range(2):
                prompts.append(stem + thought + text(scale // 2))
    else:  # agent loop
        transcript = text(3 * scale)  # tool descriptions and the task
        for _ in range(10):
            prompts.append(list(transcript))
            transcript = transcript + text(scale // 4) + text(scale // 2)  # action, result
    return Branching(name, prompts)


def shuffled(prompts: list[list[int]], seed: int) -> list[list[int]]:
    """The same prompts in a seeded random arrival order (fcfs vs lpm)."""
    order = np.random.default_rng([seed, 99]).permutation(len(prompts))
    return [prompts[i] for i in order]
