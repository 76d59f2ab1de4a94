"""Speculative decoding with drafts from suffix matches: the sequence's own tokens, its session, recent outputs.

``SpeculativeConfig`` (``config.py``) switches it on and bounds it;
``SuffixIndex`` (``suffix_index.py``) finds where the tail of a token list
occurred before; ``Drafter`` (``drafter.py``) proposes drafts per sequence and
backs off where they fail; ``verify_drafts`` (``verifier.py``) accepts them
against the model's own choices in the step that ran them.
"""

from .config import SpeculativeConfig
from .drafter import Drafter, SpeculationStats
from .verifier import split_verified, verify_drafts

__all__ = ["Drafter", "SpeculationStats", "SpeculativeConfig", "split_verified", "verify_drafts"]
