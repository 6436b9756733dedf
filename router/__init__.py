"""Prefix-aware routing: pure Python, except `router.adapter` (the only module that imports Ray)."""
