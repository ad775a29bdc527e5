"""Agent traces: loading recorded calls and measuring their ideal prefix reuse."""

from kvpilot.trace.ideal import ideal_hit_rate, ideal_hits
from kvpilot.trace.loader import TraceCall, TraceSession, load_trace_calls

__all__ = ["TraceCall", "TraceSession", "ideal_hit_rate", "ideal_hits", "load_trace_calls"]
