"""Tests of controller/checkpoints/ (the suite mirrors the code's rooms: tests/README.md)."""
