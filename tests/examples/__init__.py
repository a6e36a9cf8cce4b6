"""Tests of examples/ (the suite mirrors the code's rooms: tests/README.md)."""
