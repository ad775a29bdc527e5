"""Agent traces: loading recorded calls, their schemas, ideal prefix reuse, and diagnosis."""

from kvpilot.trace.analyze import TraceDiagnosis, diagnose
from kvpilot.trace.ideal import ideal_hit_rate, ideal_hits
from kvpilot.trace.loader import TraceCall, TraceSession, load_trace_calls
from kvpilot.trace.schema import (
    CharsPerToken,
    HashedCall,
    TraceInput,
    block_hash_ids,
    detect_trace_format,
    hashed_tokens,
    load_hashed_trace,
    load_trace_inputs,
)

__all__ = [
    "CharsPerToken",
    "HashedCall",
    "TraceCall",
    "TraceDiagnosis",
    "TraceInput",
    "TraceSession",
    "block_hash_ids",
    "detect_trace_format",
    "diagnose",
    "hashed_tokens",
    "ideal_hit_rate",
    "ideal_hits",
    "load_hashed_trace",
    "load_trace_calls",
    "load_trace_inputs",
]
