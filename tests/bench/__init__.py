"""Tests of bench/ (the suite mirrors the code's rooms: tests/README.md)."""
