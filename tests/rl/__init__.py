"""Tests for tx.rl."""
