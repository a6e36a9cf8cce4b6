"""Tests of controller/ (the suite mirrors the code's rooms: tests/README.md)."""
