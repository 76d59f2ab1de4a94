"""When a sequence stops, and the text it has produced so far.

Checked after every new token, in this order: a guided sequence's grammar
(which the token advances; a broken grammar ends it as "abort"), EOS (unless
ignored), a stop token id, a stop string (the text is cut before it, or
after it with ``include_stop_str_in_output``), a complete grammar, then the
length limits. Before ``min_tokens`` output tokens exist, EOS, stop token ids
and stop strings end nothing (the sampler also keeps EOS and stop token ids
from being picked then); a stop string is looked for from the token that
reaches ``min_tokens`` on, in the text that token adds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet

from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams
from .sequence import Sequence
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Verdict = tuple[str, str | int | None]  # (finish_reason, stop_reason)


class StopChecker:
    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, eos_token_ids: AbstractSet[int], prompt_ids: Seq[int]
    ) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids=prompt_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.text = ""
        self._longest_stop = max((len(s) for s in params.stop), default=0)

    def check(self, seq: Sequence, max_model_len: int) -> Verdict | None:
        params = self.params
        token = seq.token_ids[-1]
        guide = seq.guide
        if guide is not None and guide.holds:
            guide.advance(token)
            if guide.error is not None:
                logger.warning("request %s: guided decoding failed, sequence aborted: %s", seq.request_id, guide.error)
                return "abort", None
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None
        if may_stop and token in params.stop_token_ids:
            return "stop", token
        before = len(self.text)
        self.text += self.detokenizer.add_token(token)
        if guide is not None and not guide.holds:
            guide.watch(self.text, before)
        if seq.thinking is not None:
            seq.thinking.watch(self.text, before)
        if self._longest_stop and may_stop:
            verdict = self._match_stop_string(before)
            if verdict is not None:
                return verdict
        if guide is not None and guide.is_complete:
            self.text += self.detokenizer.flush()
            return "stop", None
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
            self.text += self.detokenizer.flush()  # a cut-off character shows as U+FFFD
            return "length", None
        return None

    def _match_stop_string(self, before: int) -> Verdict | None:
        # Only a match that ends in the new text is new; start early enough to catch it.
        window_start = max(0, before - self._longest_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self.text.find(stop, window_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop)] if self.params.include_stop_str_in_output else self.text[:index]
        return "stop", stop
