"""Requests, the sequences that run them, and the checks a request passes before it queues.

A `Request` is one call (a prompt and its sampling parameters); it runs as one `Sequence`
per branch (``n`` > 1 forks the prompt's trajectory after its prefill). A Sequence drives a
`Trajectory` of the memory core: the trajectory holds the tokens and KV, the sequence holds
what this call has produced and when. `RequestLimits` and `encode_prompt` turn a prompt into
valid token ids or a typed error (the server makes the same checks before it changes anything).
"""

from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvpilot.engine.sampling import SamplingParams
from kvpilot.errors import InvalidRequest, PromptTooLong
from kvpilot.memory.tiers import DEVICE, DISK, HOST, Tier

if TYPE_CHECKING:
    from kvpilot.memory import Trajectory

PauseHint = tuple[float | None, str | None]  # (expected tool wait, tool) announced by a turn
_NO_HITS = dict.fromkeys(Tier, 0)  # prefix hit tokens by tier, before admission
_UINT32 = np.dtype(np.uint32)  # a dtype object: frombuffer converts a type on every call


class PromptIds:
    """A request's prompt: the int32 ids it was checked into (and its trajectory holds), and
    the same as a tuple of ints, made on the first `as_tuple` and kept.

    The request and every snapshot of it share one of these, so a caller that reads the
    ids converts them once, and one that never does (the simulator, which turns millions of
    prompt ids per simulated hour) never makes a Python int per token.
    """

    __slots__ = ("_tuple", "ids")

    def __init__(self, ids: array) -> None:
        self.ids = ids  # int32; nobody changes it after the check
        self._tuple: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def as_tuple(self) -> tuple[int, ...]:
        ids = self._tuple
        if ids is None:
            ids = self._tuple = tuple(self.ids)
        return ids

    def __eq__(self, other: object) -> bool:
        """Equal ids (so that equal snapshots compare equal); unhashable, as is a snapshot."""
        if not isinstance(other, PromptIds):
            return NotImplemented
        return self.ids == other.ids

    def __repr__(self) -> str:
        return f"PromptIds({len(self.ids)} ids)"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# The members as module constants, for hot paths (as `kvpilot.memory.tiers` does): reading an
# enum member through its class (``SeqStatus.FINISHED``) is an attribute lookup each time
# (~1,000 instructions in CPython 3.11, several per turn).
WAITING, RUNNING, FINISHED = SeqStatus.WAITING, SeqStatus.RUNNING, SeqStatus.FINISHED


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    request: Request
    traj: Trajectory
    index: int  # branch index within the request (0 .. n-1)
    seed: int
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str | None = None
    prefix_reused: bool = False
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    detok_offset: int = 0  # output tokens already turned into text

    @property
    def num_tokens(self) -> int:
        return len(self.traj.tokens)

    @property
    def remaining_tokens(self) -> int:
        """Tokens whose KV is still to be computed before the next sample."""
        return len(self.traj.tokens) - self.traj.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is FINISHED


# The fields a new request is given come first, in the order `Engine.add_request` passes them
# (positionally: keyword arguments to a dataclass's __init__ cost ~6k instructions a request).
@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_ids: PromptIds  # shared uncopied by every snapshot
    params: SamplingParams
    arrival_time: float
    seed: int
    session_id: str | None = None
    salt: str | None = None
    history_tokens: int = 0  # session tokens before this turn's prompt
    pause_hint: PauseHint | None = None  # pause when the turn ends
    # When a branch stops, worked out once per request (`kvpilot.engine.outputs.stop_rule`):
    # the token ids that end it, and the stop strings it looks for in its text.
    stop_ids: frozenset[int] = frozenset()
    stop_texts: tuple[str, ...] = ()
    cached_tokens: int = 0  # prefix hit at admission (tokens whose KV was reused)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1 branches created
    aborted: bool = False
    resumed: bool = False  # a paused session's next turn
    cached_by_tier: dict[Tier, int] = field(default_factory=_NO_HITS.copy)
    released: bool = False  # finished and filed: its sequences are let go (`release`)

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt as ints (converted on the first read; `PromptIds`)."""
        return self.prompt_ids.as_tuple()

    def set_cached_by_tier(self, host_tokens: int, disk_tokens: int) -> None:
        """Split the prefix hit by the tier it came from (loads of host and disk blocks)."""
        # min(host_tokens, cached) and min(disk_tokens, cached - host) as comparisons: the
        # builtins parse their arguments as keywords (~1.8k instructions a call), per request.
        cached = self.cached_tokens
        host = host_tokens if host_tokens < cached else cached
        disk = disk_tokens if disk_tokens < cached - host else cached - host
        self.cached_by_tier = {DEVICE: cached - host - disk, HOST: host, DISK: disk}

    def release(self) -> None:
        """The engine has filed this finished request's output: let its sequences go. They
        refer back to it, so until then the two form a cycle that only the cyclic garbage
        collector frees, and its passes walk every young token list on the way."""
        assert self.finished, "only a finished request is released"
        self.released = True
        self.seqs = []

    @property
    def finished(self) -> bool:
        if self.released:
            return True
        seqs = self.seqs
        if len(seqs) == 1 and self.params.n == 1:
            return seqs[0].status is FINISHED
        return (
            bool(seqs)
            and all(s.is_finished for s in seqs)
            and (self.forked or self.params.n == 1 or self.aborted)
        )


# Not frozen, and hashed by value as a frozen one would be: a frozen dataclass's __init__
# sets each field through object.__setattr__ (~1,300 instructions a field in CPython 3.11),
# and one of these is built per branch of every snapshot. Nothing assigns to it once built.
@dataclass(slots=True, unsafe_hash=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None


class RequestOutput(NamedTuple):
    """A snapshot of a request: what it has produced so far, and whether it is done.

    Immutable like a frozen dataclass, but built as one tuple: a frozen dataclass's
    generated ``__init__`` sets each of these 11 fields through ``object.__setattr__``
    (about 5x a tuple's cost), and the engine builds a snapshot of every request that
    finishes (of every one that progressed, each step, for the server).
    """

    request_id: str
    prompt_ids: PromptIds  # the request's own; read the ids as `prompt_token_ids`
    prompt_tokens: (
        int  # tokens prefilled or reused for this call (history + prompt for a session turn)
    )
    cached_tokens: int
    cached_tokens_by_tier: dict[Tier, int]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    session_id: str | None = None

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt as a tuple of ints, made on the first read of any snapshot of this
        request and shared by all of them."""
        return self.prompt_ids.as_tuple()

    @property
    def generated_tokens(self) -> int:
        outputs = self.outputs
        if len(outputs) == 1:  # n = 1, the common case (the simulator reads it every turn)
            return len(outputs[0].token_ids)
        return sum(len(o.token_ids) for o in outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids if self.outputs else ()


def encode_prompt(tokenizer: Any, prompt: str | Seq[int], *, add_special_tokens: bool) -> list[int]:
    """A prompt (text, or token ids) as a list of token ids; InvalidRequest if it is neither."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest("this engine has no tokenizer: send token ids")
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    if isinstance(prompt, list):
        # The common case, a list of ints, converted in C; anything else takes numpy's path.
        try:
            ids = array("q", prompt)
        except (TypeError, OverflowError):
            pass
        else:
            if not (prompt and all(type(t) is bool for t in prompt)):
                return ids.tolist()
    try:
        arr = np.asarray(prompt)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"a prompt is a string or a list of token ids: {exc}") from exc
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidRequest(
            "a prompt is a string or a flat list of integer token ids "
            f"(got {arr.dtype.name} values{' nested' if arr.ndim > 1 else ''})"
        )
    return arr.tolist()


def int32_prompt(prompt: object) -> array | None:
    """A prompt of token ids as a fresh int32 array, in one pass in C, when that is what
    `encode_prompt` followed by `RequestLimits.validate_tokens` would convert it to: an
    ``array('i')``, or a list of ints (or int-likes, not all bools) within int32. None for
    anything else (text, other sequences, ids outside int32): those take the full path."""
    if isinstance(prompt, array):
        return array("i", prompt) if prompt.typecode == "i" else None
    if not isinstance(prompt, list) or (prompt and all(type(t) is bool for t in prompt)):
        return None
    try:
        return array("i", prompt)
    except (TypeError, OverflowError):
        return None


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request must fit: the model's vocabulary and context, and the device KV pool."""

    max_model_len: int
    vocab_size: int | None
    kv_blocks: int
    block_size: int
    # Every valid id read as uint32 is below this (`_check_vocabulary`), worked out once.
    id_bound: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limit = self.vocab_size
        bound = 1 << 31 if limit is None or limit > 1 << 31 else limit
        object.__setattr__(self, "id_bound", bound)

    def check_prompt(self, tokens: list[int], history: int = 0) -> array:
        """``tokens`` as the int32 ids a trajectory holds; InvalidRequest (PromptTooLong)
        unless they are in the vocabulary and may follow ``history`` tokens."""
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        ids = self.validate_tokens(tokens)
        self.check_fits(history + len(tokens), history)
        return ids

    def prompt_ids(
        self, tokenizer: Any, prompt: str | Seq[int], history: int, *, add_special_tokens: bool
    ) -> array:
        """`encode_prompt` then `check_prompt`: the prompt's token ids as int32, or the same
        errors. A prompt of ids that fits int32 (`int32_prompt`) is copied once in C and
        never turned into Python ints (a simulated hour converts millions of ids)."""
        ids = int32_prompt(prompt)
        if ids is None:
            tokens = encode_prompt(tokenizer, prompt, add_special_tokens=add_special_tokens)
            return self.check_prompt(tokens, history)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        self._check_vocabulary(ids, ids)
        self.check_fits(history + len(ids), history)
        return ids

    def validate_tokens(self, tokens: list[int]) -> array:
        """``tokens`` (not empty) as int32 ids, converted in one pass; InvalidRequest unless
        every id is in the model's vocabulary (and, without one, in int32 range)."""
        try:
            ids: array | None = array("i", tokens)
        except OverflowError:
            ids = None
        self._check_vocabulary(tokens, ids)
        assert ids is not None  # refused above: ids outside int32 are outside any vocabulary
        return ids

    def _check_vocabulary(self, tokens: Seq[int], ids: array | None) -> None:
        """InvalidRequest unless ``ids`` (``tokens`` as int32; None: they do not fit) are all
        in the model's vocabulary."""
        limit = self.vocab_size
        fits = False
        if ids is not None:
            # One pass instead of min and max: read as uint32, a negative id is at least
            # 2**31, so every id is in [0, limit) exactly when the largest is below limit.
            # The largest is found by argmax, a direct C method (a third of the fixed cost
            # of a ufunc reduction such as max, which a prompt of a few hundred ids pays).
            view = np.frombuffer(ids, _UINT32)
            fits = view.item(view.argmax()) < self.id_bound
        if not fits:
            bad = [t for t in tokens if t < 0 or (limit is not None and t >= limit)]
            if not bad:
                raise InvalidRequest("token ids must be integers in int32 range")
            raise InvalidRequest(
                f"token id(s) {bad[:5]} out of range [0, {limit}) for this model's vocabulary"
            )

    def check_fits(self, total: int, history: int = 0) -> None:
        """PromptTooLong unless a context of ``total`` tokens leaves room to generate."""
        if total >= self.max_model_len:
            raise PromptTooLong(
                f"prompt of {total} tokens (history {history} + new {total - history}) leaves "
                f"no room to generate within the model context of {self.max_model_len} tokens"
            )
        capacity = self.kv_blocks * self.block_size
        if total + 1 > capacity:
            raise PromptTooLong(
                f"prompt of {total} tokens exceeds the KV pool of {capacity} tokens "
                f"({self.kv_blocks} blocks of {self.block_size}): give the engine more KV memory"
            )


def pause_hint(
    expected_tool_wait_s: float | None, tool: str | None, *, on_session: bool
) -> PauseHint | None:
    """The pause a turn announces (it pauses its session when it ends), checked."""
    if expected_tool_wait_s is None and tool is None:
        return None
    if not on_session:
        raise InvalidRequest("expected_tool_wait_s and tool need a session")
    if expected_tool_wait_s is not None and not 0 <= expected_tool_wait_s < math.inf:
        raise InvalidRequest(
            "expected_tool_wait_s must be a finite, non-negative number of seconds"
        )
    return (expected_tool_wait_s, tool)
