"""An episode's captured calls as one training row: prompt, completion, logprobs and the model's-token mask.

An agent's episode is many model calls; a trainer wants one sequence. When
each call's prompt is the previous call's prompt and completion followed by
what the environment and the agent's scaffolding added (a terminal's output, a
parse error), the episode is one sequence: the first call's prompt, then each
completion (the model's tokens, ``env_mask`` 1) and each addition between two
calls (``env_mask`` 0, never trained on). An agent that re-templates or
summarises its history (terminus-2 can) breaks that chain: the row stops at the
last call that continues it and the calls after it are counted as ``dropped``.

Only the server's own token ids make a call exact (``tokens_from_server``). A
call without them (a server that gives none) is re-tokenized by the caller
with the model's tokenizer (:func:`retokenized`) and its logprobs are NaN
(unknown: TRL gives such tokens no importance-sampling correction).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: A call's ids by the model's tokenizer: (prompt ids, completion ids), for a call the server gave none;
#: ``None``: a reply the tokenizer cannot render as the model wrote it (the row ends there).
Retokenizer = Callable[[dict[str, Any], dict[str, Any]], tuple[list[int], list[int]] | None]


@dataclass(frozen=True)
class TokenRow:
    """One episode's sequence (see the module docs)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]  # 1: a token the model generated; 0: the environment's or the scaffolding's
    calls: int = 0  # the calls in the row
    dropped: int = 0  # answered calls left out: they did not continue the row (a re-templated history)
    truncated: bool = False  # cut at the completion budget
    retokenized: int = 0  # calls whose ids came from the tokenizer, not the server
    model_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_tokens", sum(self.env_mask))


def token_row(
    calls: Sequence[dict[str, Any]],
    *,
    max_completion_length: int | None = None,
    retokenize: Retokenizer | None = None,
) -> TokenRow | None:
    """The row of an episode's captured ``calls`` (each as :meth:`CapturedCall.to_json` writes it).

    ``max_completion_length`` cuts the completion (environment tokens count toward it, as in TRL's rows);
    ``retokenize`` gives the ids of a call the server gave none (without it such a call ends the row).
    ``None``: no answered call to start a row from.
    """
    prompt: list[int] = []
    completion: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    used = dropped = retokenized = 0
    answered = [call for call in calls if call.get("status") == 200]
    for index, call in enumerate(answered):
        ids = _ids(call, retokenize)
        if ids is None:
            dropped = len(answered) - index
            break
        call_prompt, call_completion, call_logprobs, from_tokenizer = ids
        if used == 0:
            prompt = list(call_prompt)
        else:
            so_far = prompt + completion
            if call_prompt[: len(so_far)] != so_far:  # the agent re-templated its history: the row ends here
                dropped = len(answered) - index
                break
            added = call_prompt[len(so_far) :]
            completion += added
            logprobs += [0.0] * len(added)
            mask += [0] * len(added)
        completion += call_completion
        logprobs += call_logprobs
        mask += [1] * len(call_completion)
        used += 1
        retokenized += from_tokenizer
    if used == 0:
        return None
    truncated = max_completion_length is not None and len(completion) > max_completion_length
    if truncated:
        assert max_completion_length is not None
        completion, logprobs, mask = (x[:max_completion_length] for x in (completion, logprobs, mask))  # type: ignore[assignment]
    return TokenRow(prompt, completion, logprobs, mask, calls=used, dropped=dropped, truncated=truncated, retokenized=retokenized)


def _ids(call: dict[str, Any], retokenize: Retokenizer | None) -> tuple[list[int], list[int], list[float], int] | None:
    """(prompt ids, completion ids, logprobs, 1 if re-tokenized) of one answered call; ``None``: it has none."""
    prompt, completion = call.get("prompt_token_ids"), call.get("completion_token_ids")
    if prompt and completion is not None:
        given = call.get("logprobs")
        logprobs = [float(x) for x in given] if given and len(given) == len(completion) else [math.nan] * len(completion)
        return list(prompt), list(completion), logprobs, 0
    if retokenize is None or not isinstance(call.get("request"), dict) or not isinstance(call.get("reply"), dict):
        return None
    ids = retokenize(call["request"], call["reply"])
    if ids is None:
        return None
    prompt, completion = ids
    return prompt, completion, [math.nan] * len(completion), 1
