"""Tests of docs/ (the suite mirrors the code's rooms: tests/README.md)."""
