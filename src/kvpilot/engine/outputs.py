"""Turning sequences into what callers see: text, snapshots, stop conditions."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from kvpilot.engine.request import CompletionOutput, Request, RequestOutput, Sequence
from kvpilot.engine.sampling import SamplingParams

_NO_IDS: frozenset[int] = frozenset()
# `RequestOutput(...)` without the named tuple's generated ``__new__`` (a Python function
# that calls just this): a snapshot is built of every request that finishes.
_new_tuple = tuple.__new__


def decode(tokenizer: Any, token_ids: Seq[int]) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def seq_text(tokenizer: Any, seq: Sequence) -> str:
    """The sequence's output text, decoded again only when tokens were added."""
    if seq.detok_offset == -1:  # cut by a stop string: final
        return seq.output_text
    if seq.detok_offset != len(seq.output_token_ids):
        seq.output_text = decode(tokenizer, seq.output_token_ids)
        seq.detok_offset = len(seq.output_token_ids)
    return seq.output_text


def snapshot(request: Request, tokenizer: Any, finished: bool | None = None) -> RequestOutput:
    """What ``request`` has produced so far (``finished``: `Request.finished`, when the
    caller has just read it)."""
    seqs = request.seqs
    if len(seqs) == 1:  # the common case (n = 1), without sorting and gathering
        s = seqs[0]
        # Without a tokenizer there is no text, nor stop strings to cut it (`stop_rule`).
        text = "" if tokenizer is None else seq_text(tokenizer, s)
        outputs: tuple[CompletionOutput, ...] = (
            CompletionOutput(s.index, text, tuple(s.output_token_ids), s.finish_reason),
        )
        first = s.first_token_time
        done = s.finish_time
    else:
        outputs = tuple(
            CompletionOutput(
                s.index, seq_text(tokenizer, s), tuple(s.output_token_ids), s.finish_reason
            )
            for s in sorted(seqs, key=lambda s: s.index)
        )
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        finishes = [s.finish_time for s in seqs if s.finish_time is not None]
        first = min(firsts) if firsts else None
        done = max(finishes) if finishes else None
    if finished is None:
        finished = request.finished
    prompt = request.prompt_ids
    return _new_tuple(  # RequestOutput(...), its fields in order (see `_new_tuple`)
        RequestOutput,
        (
            request.request_id,
            prompt,  # the request's own: its ids become ints only if someone reads them
            request.history_tokens + len(prompt.ids),  # the ids' len: no Python __len__
            request.cached_tokens,
            dict(request.cached_by_tier),
            outputs,
            finished,
            request.arrival_time,
            first,
            done if finished else None,
            request.session_id,
        ),
    )


def stop_rule(
    params: SamplingParams, eos_token_ids: frozenset[int], tokenizer: Any
) -> tuple[frozenset[int], tuple[str, ...]]:
    """What ends a branch of a request with ``params``, worked out once per request (a
    `Request`'s ``stop_ids`` and ``stop_texts``): its stop token ids and the model's EOS
    unless it ignores them, and its stop strings when there is a tokenizer to find them."""
    ids = frozenset(params.stop_token_ids) if params.stop_token_ids else _NO_IDS
    if eos_token_ids and not params.ignore_eos:
        ids = eos_token_ids | ids
    return ids, (params.stop if tokenizer is not None else ())


def stop_reason(seq: Sequence, token: int, tokenizer: Any, max_model_len: int) -> str | None:
    """Why ``seq`` stops after sampling ``token`` ("stop", "length"), or None to go on
    (hot path: every token a step samples). The request's `stop_rule` says which tokens and
    strings stop it.

    A stop string cuts the output text where it begins (the text is final from then on).
    """
    request = seq.request
    if token in request.stop_ids:
        return "stop"
    stops = request.stop_texts
    if stops:
        text = decode(tokenizer, seq.output_token_ids)
        window = len(seq.output_text) - max(len(s) for s in stops)
        cut = find_stop(text, stops, max(0, window))
        seq.output_text = text if cut is None else text[:cut]
        if cut is not None:
            seq.detok_offset = -1  # text is final
            return "stop"
    if len(seq.output_token_ids) >= request.params.max_tokens:
        return "length"
    if len(seq.traj.tokens) >= max_model_len:
        return "length"
    return None


def find_stop(text: str, stops: Seq[str], start: int) -> int | None:
    """Where the earliest stop string begins at or after ``start``, if any."""
    cuts = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(cuts) if cuts else None


def as_prompt_list(prompts: Any) -> list[str | list[int]]:
    """One prompt (text or token ids) or many, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return [p if isinstance(p, str) else list(p) for p in items]
