"""The prefix-break classifier: each cause from a crafted pair of requests."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvpilot.promptcache.breaks import BreakCause, PromptView, classify_break
from kvpilot.promptcache.conversations import BreakDetector
from kvpilot.promptcache.volatile import find_volatile_field

SYSTEM = "You are a careful coding agent. Work in small steps and run the tests."
TOOLS = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "edit", "parameters": {"type": "object"}}},
]


def render(messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    """A stand-in chat template: tools as JSON after the system prompt, then each message."""
    out = []
    for i, m in enumerate(messages):
        out.append(f"<|{m['role']}|>\n{m['content']}")
        if i == 0 and tools:
            out.append("# Tools\n" + "\n".join(json.dumps(t) for t in tools))
        out.append("<|end|>\n")
    return "".join(out)


def view(messages: list[dict[str, Any]], tools: list[Any] | None = TOOLS) -> PromptView:
    text = render(messages, tools)
    return PromptView.of_chat(list(text.encode()), text, messages, tools)


def conversation(n_turns: int, system: str = SYSTEM, task: str = "Fix the bug in utils.py") -> list:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": task},
    ]
    for t in range(n_turns):
        msgs.append({"role": "assistant", "content": f"THOUGHT: step {t}\n```bash\nls dir{t}\n```"})
        msgs.append({"role": "user", "content": f"<output>file_{t}.py\nREADME</output>"})
    return msgs


def test_appending_is_not_a_break() -> None:
    assert classify_break(view(conversation(2)), view(conversation(3))) is None


def test_extending_the_last_message_is_not_a_break() -> None:
    a = conversation(2)
    b = [*a[:-1], {"role": "user", "content": a[-1]["content"] + "\nmore output"}]
    assert classify_break(view(a), view(b)) is None
    c = [*a[:-1], {"role": "user", "content": "other" + a[-1]["content"]}]
    assert classify_break(view(a), view(c)) is not None


def test_timestamp_at_head_of_system_prompt_is_volatile_field_at_head() -> None:
    a = view(conversation(2, system="Current time: 2025-06-01 10:31:07\n" + SYSTEM))
    b = view(conversation(3, system="Current time: 2025-06-01 10:32:44\n" + SYSTEM))
    brk = classify_break(a, b)
    assert brk is not None
    assert brk.cause is BreakCause.VOLATILE_AT_HEAD
    assert brk.location.field == "system"
    assert brk.volatile == {"kind": "timestamp", "old": "10:31:07", "new": "10:32:44"}
    # The first divergent token is the first differing character (byte tokens here).
    assert brk.token_index == len("<|system|>\nCurrent time: 2025-06-01 10:3")
    assert brk.location.before.endswith("10:3") and brk.location.new.startswith("2:44")
    assert "cause=volatile_field_at_head" in brk.header()


def test_uuid_in_first_user_message_is_volatile_at_head() -> None:
    a = view(conversation(1, task="request 3f2a9c1e-1111-2222-3333-444455556666: fix it"))
    b = view(conversation(2, task="request 9d2a9c1e-1111-2222-3333-444455550000: fix it"))
    brk = classify_break(a, b)
    assert brk is not None and brk.cause is BreakCause.VOLATILE_AT_HEAD
    assert (brk.location.field, brk.location.message_index, brk.location.role) == (
        "content",
        1,
        "user",
    )


def test_counter_in_history_is_volatile_field() -> None:
    a, b = conversation(3), conversation(4)
    b[4] = {"role": "user", "content": "<output>file_0.py\nREADME</output> (turn 2)"}
    a[4] = {"role": "user", "content": "<output>file_0.py\nREADME</output> (turn 1)"}
    brk = classify_break(view(a), view(b))
    assert brk is not None and brk.cause is BreakCause.VOLATILE
    assert brk.location.message_index == 4


def test_tool_added_is_tool_list_changed() -> None:
    more = [*TOOLS, {"type": "function", "function": {"name": "grep", "parameters": {}}}]
    brk = classify_break(view(conversation(2)), view(conversation(3), more))
    assert brk is not None and brk.cause is BreakCause.TOOLS_CHANGED
    assert brk.location.field == "tools"
    assert "grep" in brk.detail


def test_tools_in_another_order_are_reordered() -> None:
    brk = classify_break(view(conversation(2)), view(conversation(3), TOOLS[::-1]))
    assert brk is not None and brk.cause is BreakCause.REORDERED


def test_tool_json_with_other_key_order_is_reserialized() -> None:
    reordered = [dict(reversed(list(t.items()))) for t in TOOLS]
    brk = classify_break(view(conversation(2)), view(conversation(3), reordered))
    assert brk is not None and brk.cause is BreakCause.REORDERED
    assert "serialised" in brk.detail


def test_tool_call_arguments_reserialized() -> None:
    a, b = conversation(2), conversation(3)
    a[2] = {"role": "assistant", "content": json.dumps({"cmd": "ls", "cwd": "/"})}
    b[2] = {"role": "assistant", "content": json.dumps({"cwd": "/", "cmd": "ls"}, indent=1)}
    brk = classify_break(view(a), view(b))
    assert brk is not None and brk.cause is BreakCause.REORDERED
    assert brk.location.message_index == 2


def test_messages_swapped_are_reordered() -> None:
    a = conversation(3)
    b = conversation(3)
    b[2], b[4] = b[4], b[2]
    b[3], b[5] = b[5], b[3]
    brk = classify_break(view(a), view(b))
    assert brk is not None and brk.cause is BreakCause.REORDERED


def test_summary_replacing_turns_is_history_compacted() -> None:
    a = conversation(5)
    b = [*a[:2], {"role": "user", "content": "Summary of the work so far: listed 5 dirs."}, *a[-2:]]
    brk = classify_break(view(a), view(b))
    assert brk is not None and brk.cause is BreakCause.COMPACTED
    assert brk.location.message_index == 2
    assert brk.lost_tokens > 0


def test_truncated_history_is_history_compacted() -> None:
    a = conversation(4)
    brk = classify_break(view(a), view(a[:5]))
    assert brk is not None and brk.cause is BreakCause.COMPACTED


def test_different_system_prompt_is_another_conversation() -> None:
    sub = conversation(1, system="You are a sub-agent that only reads files.", task="Read x")
    brk = classify_break(view(conversation(3)), view(sub))
    assert brk is not None and brk.cause is BreakCause.INTERLEAVED
    assert brk.location.field == "system"


def test_edited_message_is_history_edited() -> None:
    a, b = conversation(3), conversation(3)
    b[3] = {"role": "user", "content": "<output>a completely different observation</output>"}
    brk = classify_break(view(a), view(b))
    assert brk is not None and brk.cause is BreakCause.EDITED


def test_text_only_prompts_without_structure() -> None:
    a = "Date: 2025-06-01\n" + "x" * 400
    b = "Date: 2025-06-02\n" + "x" * 420
    brk = classify_break(PromptView(list(a.encode()), a), PromptView(list(b.encode()), b))
    assert brk is not None and brk.cause is BreakCause.VOLATILE_AT_HEAD
    assert brk.location.field == "prompt"
    tokens_only = classify_break(PromptView([1, 2, 3] * 50), PromptView([9] * 100))
    assert tokens_only is not None and tokens_only.cause is BreakCause.INTERLEAVED


def test_detector_recognises_two_interleaved_conversations() -> None:
    detector = BreakDetector(block_size=4)
    sub = "You are a sub-agent that only reads files."
    seen = []
    for turn in range(1, 5):
        seen.append(detector.observe(view(conversation(turn))))
        seen.append(detector.observe(view(conversation(turn, system=sub, task="Read x"))))
    assert [o.conversation for o in seen] == [0, 1] * 4
    assert all(o.prefix_break is not None for o in seen[1:])
    assert all(o.prefix_break.cause is BreakCause.INTERLEAVED for o in seen[1:] if o.prefix_break)
    assert not any(o.breaks_conversation for o in seen)
    # After its first request, each conversation reuses its own previous prompt.
    assert all(o.reused_tokens > 0 for o in seen[2:])
    assert detector.num_conversations == 2


def test_detector_keeps_a_real_break_within_a_conversation() -> None:
    detector = BreakDetector(block_size=4)
    detector.observe(view(conversation(2)))
    obs = detector.observe(view(conversation(3), TOOLS[:1]))
    assert obs.conversation == 0 and obs.breaks_conversation
    assert obs.prefix_break is not None and obs.prefix_break.cause is BreakCause.TOOLS_CHANGED


@given(st.text(min_size=1, max_size=60), st.integers(0, 10**6), st.integers(0, 10**6))
def test_volatile_field_finds_a_changed_counter_anywhere(text: str, x: int, y: int) -> None:
    old, new = f"{text} #{x} {text}", f"{text} #{y} {text}"
    found = find_volatile_field(old, new)
    if x == y:
        assert found is None
    else:
        assert found is not None
        assert old[: found.offset] == new[: found.offset]
        assert str(x).endswith(found.old) or found.old.endswith(str(x)) or str(x) in found.old


@given(st.lists(st.integers(0, 50), min_size=1, max_size=80), st.data())
def test_break_token_index_is_first_difference(tokens: list[int], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(tokens) - 1))
    changed = [*tokens[:cut], tokens[cut] + 1, *tokens[cut + 1 :]]
    brk = classify_break(PromptView(tokens), PromptView(changed))
    assert brk is not None
    assert brk.token_index == cut
    assert brk.lost_tokens == len(tokens) - cut
    assert classify_break(PromptView(tokens), PromptView([*tokens, 7])) is None
