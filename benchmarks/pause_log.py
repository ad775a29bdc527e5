"""bench_pause.py --log-pauses: every pause's inputs and decision, with the wait it really had.

`PauseLog.attach(engine, run)` wraps the engine's `OffloadManager.pause` and ``on_resume``
(on the instance): each pause records what the policy was told (predicted or true wait, tool,
pressures, sizes, measured reload and recompute times) and what it chose; the resume adds the
wait the session really had. Policies that ran on the same waits can then be compared pause
by pause (``breakeven`` against ``oracle`` or ``infercept``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpilot.engine import Engine
from kvpilot.policy.breakeven import PauseDecision


class PauseLog:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def attach(self, engine: Engine, run: dict[str, Any]) -> None:
        """Record ``engine``'s pauses, each row tagged with ``run`` (policy, draw...)."""
        offload = engine.offload
        pause, on_resume = offload.pause, offload.on_resume
        open_rows: dict[str, dict[str, Any]] = {}

        def logged_pause(
            session: Any, expected_wait_s: float | None = None, tool: str | None = None
        ) -> PauseDecision:
            decision = pause(session, expected_wait_s, tool)
            record = offload.records[session.session_id]
            inputs = record.inputs
            row = {
                **run,
                "session": session.session_id,
                "at_s": round(record.paused_at, 4),
                "tool": tool,
                "wait_s": round(inputs.expected_wait_s, 4),
                "wait_source": record.wait_source,
                "action": str(decision.action),
                "via": str(decision.via),
                "device_pressure": round(inputs.device_pressure, 4),
                "host_pressure": round(inputs.host_pressure, 4),
                "kv_bytes": inputs.kv_bytes,
                "tokens": inputs.num_tokens,
                "host_free_bytes": inputs.host_free_bytes,
                "device_used_bytes": inputs.device_used_bytes,
                "recompute_s": round(decision.recompute_s, 5),
                "reload_s": round(decision.reload_s, 5),
                "disk_reload_s": round(decision.disk_reload_s, 5),
                "break_even_wait_s": round(decision.break_even_wait_s, 5),
                "actual_wait_s": None,
            }
            self.rows.append(row)
            open_rows[session.session_id] = row
            return decision

        def logged_resume(session: Any) -> None:
            row = open_rows.pop(session.session_id, None)
            if row is not None:
                row["actual_wait_s"] = round(offload.now() - row["at_s"], 4)
                record = offload.records.get(session.session_id)
                if record is not None:  # a demotion may have moved the state since the pause
                    row["resumed_action"] = str(record.action)
                    row["resumed_state"] = str(record.state)
            on_resume(session)

        offload.pause = logged_pause  # type: ignore[method-assign]
        offload.on_resume = logged_resume  # type: ignore[method-assign]

    def write(self, path: Path) -> None:
        with path.open("w") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")
