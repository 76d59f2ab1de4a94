"""OpenAI's logit bias and frequency and presence penalties as a transformers logits processor: the reference the
engine's and the server's outputs are checked against."""

from __future__ import annotations

import torch
import transformers


class OpenAIPenalties:
    """transformers' sequence-bias processor for ``bias``, then OpenAI's frequency and presence penalties (their
    published formula: ``logit[j] -= c[j] * frequency + (c[j] > 0) * presence``, ``c[j]`` the count of token ``j``
    among the tokens generated after the prompt's ``prompt_len``)."""

    def __init__(self, prompt_len: int, bias: dict[int, float], frequency: float, presence: float) -> None:
        sequence_bias = {(token,): value for token, value in bias.items()}
        self.bias = transformers.SequenceBiasLogitsProcessor(sequence_bias) if bias else None
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self.bias(input_ids, scores) if self.bias is not None else scores.clone()
        generated = input_ids[0, self.prompt_len :].tolist()
        for token in set(generated):
            scores[0, token] -= generated.count(token) * self.frequency + self.presence
        return scores
