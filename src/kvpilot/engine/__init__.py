"""The engine: scheduler, step loop, clock, sampling parameters, sessions."""
