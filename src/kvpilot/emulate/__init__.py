"""Accelerator ratios emulated on CPU: links slowed to a named target's reload : recompute.

`target.py` reads the target's ratios from the hardware presets and a model's geometry;
`link.py` schedules copies on an emulated link; `transport.py` and `disk.py` wrap the tier
transport and the disk store with it. Torch-free.
"""
