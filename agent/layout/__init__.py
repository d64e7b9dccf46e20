"""Layouts: which box of each tensor a rank holds or needs, from parallelism rules and model presets."""
