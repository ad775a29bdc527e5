"""`kvpilot demo`: the main job on built-in defaults."""
