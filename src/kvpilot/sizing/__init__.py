"""Sizing: model geometry, accelerator presets, the capacity plan and the allocator lab."""
