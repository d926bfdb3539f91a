"""Test suites shipped with kvstore-tiers for backend authors (they need pytest)."""
