"""Every speculative decoding proposer, by its speculative_config method: the one registry.

A new proposer is one new file (a `Proposer` subclass, proposer.py says what it provides) and
one entry in PROPOSERS. The engine, its start-up line and the simulator ask this module; none
of them names a method.
"""

from __future__ import annotations

import dataclasses

from refserve.spec_decode.draft_model import DraftModelProposer
from refserve.spec_decode.ngram import NgramProposer
from refserve.spec_decode.proposer import Proposer
from refserve.speculative_config import SpeculativeConfig

PROPOSERS: dict[str, type[Proposer]] = {
    NgramProposer.method: NgramProposer,
    DraftModelProposer.method: DraftModelProposer,
}


def resolve(spec: SpeculativeConfig, config=None
            ) -> tuple[type[Proposer], SpeculativeConfig]:
    """The proposer class of `spec.method` and `spec` with its options checked and
    completed (every key of the method, its default where unset). ValueError names an
    unknown method or a key the method does not take. `config`: the EngineConfig."""
    cls = PROPOSERS.get(spec.method)
    if cls is None:
        raise ValueError(f"speculative_config.method={spec.method!r}: choose one of "
                         f"{', '.join(PROPOSERS)}")
    for key in spec.options:
        if key not in cls.options:
            owners = [m for m, c in PROPOSERS.items() if key in c.options]
            raise ValueError(f"speculative_config.{key} applies only to method "
                             f"{' / '.join(repr(m) for m in owners)}" if owners else
                             f"speculative_config: unknown key {key!r}")
    options = cls.check_options({**cls.options, **spec.options}, config)
    return cls, dataclasses.replace(spec, options=options)
