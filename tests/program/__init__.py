"""Tests of program/ (the suite mirrors the code's rooms: tests/README.md)."""
